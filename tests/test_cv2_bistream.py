"""Bistream (text-in streaming) input layout and session on the tiny golden LLM."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from voicertc.backends.cosyvoice.llm.bistream import (
    BistreamSession,
    Segment,
    embed_segments,
    plan_next_input,
)
from voicertc.backends.cosyvoice.llm.qwen2lm import EOS_ID, LlmConfig, build_llm
from voicertc.backends.cosyvoice.load.yaml_config import load_yaml

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def llm(golden_dir):
    sys.path.insert(0, str(golden_dir))
    import make_weights

    node = load_yaml(golden_dir / "model_dir" / "cosyvoice2.yaml")["llm"]
    cfg = LlmConfig.from_yaml(node, golden_dir / "model_dir" / "CosyVoice-BlankEN" / "config.json")
    manifest = json.loads((golden_dir / "tiny_llm_manifest.json").read_text())
    recipe = json.loads((golden_dir / "tiny_llm_recipe.json").read_text())
    return build_llm(cfg, make_weights.state_dict(manifest, recipe), "llm.pt")


def coalesce(segments: list[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for seg in segments:
        if out and out[-1].kind == seg.kind and seg.kind in ("text", "speech"):
            out[-1] = Segment(seg.kind, out[-1].tokens + seg.tokens)
        else:
            out.append(seg)
    return out


def T(*ids: int) -> Segment:
    return Segment("text", tuple(ids))


def S(ids) -> Segment:
    return Segment("speech", tuple(ids))


def test_plan_interleaves_prompt_speech_in_5_15_groups():
    plan = plan_next_input(list(range(12)), list(range(100, 130)), awaiting_text=True, text_ended=False)
    assert plan is not None and not plan.final
    assert plan.segments == (T(0, 1, 2, 3, 4), S(range(100, 115)), T(5, 6, 7, 8, 9), S(range(115, 130)))
    assert (plan.text_used, plan.prompt_speech_used) == (10, 30)


def test_plan_waits_until_prompt_speech_is_used_up():
    assert plan_next_input([1, 2, 3, 4, 5], list(range(20)), awaiting_text=True, text_ended=False) is None
    assert plan_next_input([1, 2, 3, 4], [], awaiting_text=True, text_ended=False) is None
    plan = plan_next_input([1, 2, 3, 4, 5, 6], [], awaiting_text=True, text_ended=False)
    assert plan is not None and plan.segments == (T(1, 2, 3, 4, 5),) and plan.text_used == 5


def test_plan_at_text_end_puts_rest_then_task_id_then_unused_prompt_speech():
    plan = plan_next_input([1, 2, 3, 4, 5, 6, 7], list(range(20)), awaiting_text=True, text_ended=True)
    assert plan is not None and plan.final
    assert plan.segments == (T(1, 2, 3, 4, 5), S(range(15)), T(6, 7), Segment("task_id"), S(range(15, 20)))
    plan = plan_next_input([], [], awaiting_text=True, text_ended=True)
    assert plan is not None and plan.segments == (Segment("task_id"),)


def test_session_toy_walk_matches_hand_built_layout(llm):
    prompt_speech = list(range(1000, 1020))  # P = 20: the first fill is due after 10 generated tokens
    session = BistreamSession.start(llm, [1, 2, 3], prompt_speech, sampling="greedy")
    assert session.next_fill_index == 10
    emitted: list[int] = []

    def run() -> None:
        while not session.needs_text and not session.finished:
            token = session.step(force=2000 + len(emitted))  # ignored where a fill is due
            if token is not None:
                emitted.append(token)

    session.push_text([10, 11])
    run()
    assert emitted == [] and session.needs_text  # 5 prompt speech tokens still wait for text
    session.push_text([12, 13, 14, 15, 16, 17])
    run()
    assert emitted == list(range(2000, 2010))  # speech before the text stream has ended
    assert session.out_tokens[-1] == 6563 and session.next_fill_index == 26
    session.push_text([18, 19, 20, 21, 22, 23, 24])
    run()
    assert len(emitted) == 25
    session.end_text()
    assert session.step(force=2025) == 2025
    assert session.step(force=2026) == 2026
    assert session.step(force=EOS_ID) is None and session.finished
    expected = [
        Segment("sos"),
        T(1, 2, 3, 10, 11),
        S(range(1000, 1015)),
        T(12, 13, 14, 15, 16),
        S(list(range(1015, 1020)) + list(range(2000, 2010))),
        T(17, 18, 19, 20, 21),
        S(range(2010, 2025)),
        T(22, 23, 24),
        Segment("task_id"),
        S([2025, 2026]),
    ]
    assert coalesce(session.fed) == expected


def test_session_cache_equals_one_forward_over_the_layout(llm):
    session = BistreamSession.start(llm, [5, 6], [], sampling="greedy")
    session.push_text(list(range(20, 32)))
    for _ in range(40):
        if session.needs_text:
            break
        session.step()
    assert session.out_tokens.count(6563) >= 1
    with torch.inference_mode():
        full = llm.llm_decoder(llm.llm(embed_segments(llm, session.fed)))[0, -1]
    torch.testing.assert_close(session.logits, full, atol=1e-4, rtol=0)


def test_session_without_prompt_speech_fills_every_16(llm):
    session = BistreamSession.start(llm, [], [], sampling="greedy")
    assert session.next_fill_index == 15
    session.push_text([1, 2, 3, 4])
    assert session.needs_text and session.step() is None
    session.push_text(list(range(5, 16)))
    tokens = []
    while not session.needs_text:
        token = session.step()
        if token is not None:
            tokens.append(token)
    assert len(tokens) == 45 and all(0 <= t < 6561 for t in tokens)  # 15 text tokens = 3 groups
    assert [i for i, t in enumerate(session.out_tokens) if t == 6563] == [15, 31, 47]
    session.end_text()
    while not session.finished:
        session.step()
    assert session.final_tokens <= 20 * 15


def test_sampled_session_ends(llm):
    session = BistreamSession.start(llm, [7, 8], [], generator=torch.Generator().manual_seed(3))
    for piece in ([1, 2, 3], [4, 5, 6, 7], [8]):
        session.push_text(piece)
        while not session.needs_text and not session.finished:
            session.step()
    session.end_text()
    while not session.finished:
        session.step()
    assert all(0 <= t < 6561 or t == 6563 for t in session.out_tokens)


def test_bad_ids_raise(llm):
    with pytest.raises(ValueError, match="speech token id 6561"):
        BistreamSession.start(llm, [1], [6561])
    session = BistreamSession.start(llm, [1], [])
    with pytest.raises(ValueError, match="text token id 1000"):
        session.push_text([1000])
