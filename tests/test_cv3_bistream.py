"""CosyVoice3 bistream (text-in streaming) on the tiny golden v3 LLM.

The reference defines no bistream == whole-text equality in general (the two input layouts differ), so:
* the documented rule: whatever the deltas, what the session feeds is the training layout of
  `prepare_lm_input_target` — [sos, instruct (the prompt text up to `<|endofprompt|>`), 5 text, 15
  speech, ..., rest of the text, task_id, rest of the speech] over text = transcript ⧺ pushed text and
  speech = prompt speech ⧺ generated — checked as a hypothesis property against an independent oracle;
* the tokens do not depend on how the text was cut into deltas (property, seeded RAS on the real LLM);
* where the layouts coincide (text that ends before a 5-token group forms, no prompt speech) the
  bistream run equals the whole-text (unistream) run step for step.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from voicertc.backends.cosyvoice.llm.bistream import (
    V3_IDS,
    BistreamSession,
    Segment,
    bistream_ids,
    embed_segments,
    first_fill_index,
)
from voicertc.backends.cosyvoice.llm.v3 import ENDOFPROMPT_ID, EOS_ID, FILL_ID, STOP_IDS

SETTINGS = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
INSTRUCT = (40, 41, 42, ENDOFPROMPT_ID)  # "<system prompt><|endofprompt|>"


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def llm(cv3_model):
    return cv3_model.llm


def coalesce(segments: Sequence[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for seg in segments:
        if seg.kind in ("text", "speech") and not seg.tokens:
            continue
        if out and out[-1].kind == seg.kind and seg.kind in ("text", "speech"):
            out[-1] = Segment(seg.kind, out[-1].tokens + seg.tokens)
        else:
            out.append(seg)
    return out


def training_layout(instruct: Sequence[int], text: Sequence[int], speech: Sequence[int]) -> list[Segment]:
    """The oracle: the official training input of a bistream sequence (`prepare_lm_input_target`)."""

    def T(ids: Sequence[int]) -> Segment:
        return Segment("text", tuple(ids))

    def S(ids: Sequence[int]) -> Segment:
        return Segment("speech", tuple(ids))

    out = [Segment("sos"), T(instruct)]
    j = 0
    while len(text) - 5 * j >= 5:
        out += [T(text[5 * j : 5 * j + 5]), S(speech[15 * j : 15 * j + 15])]
        j += 1
    out += [T(text[5 * j :]), Segment("task_id"), S(speech[15 * j :])]
    return coalesce(out)


def run_until_blocked(session: BistreamSession, emitted: list[int], force: bool) -> None:
    while not session.needs_text and not session.finished:
        token = session.step(force=1000 + len(emitted) if force else None)
        if token is not None:
            emitted.append(token)


def cut(tokens: Sequence[int], cuts: Sequence[int]) -> list[list[int]]:
    edges = [0, *sorted({c % (len(tokens) + 1) for c in cuts}), len(tokens)]
    return [list(tokens[a:b]) for a, b in zip(edges, edges[1:], strict=False)]


def test_v3_ids_and_the_instruct_head(llm):
    assert bistream_ids(llm) is V3_IDS
    assert (V3_IDS.fill, V3_IDS.eos) == (FILL_ID, EOS_ID) == (6564, 6562)
    assert set(V3_IDS.ban_before_final) == STOP_IDS - {6564}
    with pytest.raises(ValueError, match="endofprompt"):
        BistreamSession.start(llm, [40, 41], [])
    session = BistreamSession.start(llm, [*INSTRUCT, 7, 8], list(range(20)))
    assert session.pending == [Segment("sos"), Segment("text", INSTRUCT)]
    assert session.text_queue == [7, 8] and session.next_fill_index == 10
    assert session.needs_text  # 3 more text tokens before the first [5 text, 15 speech] group


def test_first_fill_index():
    assert [first_fill_index(p) for p in (0, 1, 14, 15, 20, 30, 31)] == [15, 14, 1, 0, 10, 0, 14]


@SETTINGS
@given(
    transcript=st.lists(st.integers(50, 99), max_size=12),
    n_prompt_speech=st.integers(0, 40),
    text=st.lists(st.integers(100, 199), max_size=30),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    n_final=st.integers(0, 4),
)
@example(transcript=[50] * 5, n_prompt_speech=15, text=list(range(100, 112)), cuts=[3], n_final=1)
@example(transcript=[50] * 7, n_prompt_speech=30, text=list(range(100, 110)), cuts=[], n_final=0)
def test_fed_layout_is_the_training_layout_whatever_the_deltas(
    llm, transcript, n_prompt_speech, text, cuts, n_final
):
    prompt_speech = list(range(3000, 3000 + n_prompt_speech))
    session = BistreamSession.start(llm, [*INSTRUCT, *transcript], prompt_speech, sampling="greedy")
    emitted: list[int] = []
    for delta in cut(text, cuts):
        session.push_text(delta)
        run_until_blocked(session, emitted, force=True)
        assert not session.finished
    session.end_text()
    for _ in range(n_final):
        assert session.step(force=1000 + len(emitted)) == 1000 + len(emitted)
        emitted.append(1000 + len(emitted))
    assert session.step(force=EOS_ID) is None and session.finished
    speech = [*prompt_speech, *emitted]
    assert coalesce(session.fed) == training_layout(INSTRUCT, [*transcript, *text], speech)
    fills = [i for i, t in enumerate(session.out_tokens) if t == FILL_ID]
    assert all(tok < 6561 for tok in emitted) and len(emitted) + len(fills) == len(session.out_tokens)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(0, 40), min_size=1, max_size=8))
def test_sampled_tokens_do_not_depend_on_the_deltas(llm, cuts):
    text = list(range(300, 318))

    def speak(deltas: list[list[int]]) -> tuple[list[int], list[Segment]]:
        session = BistreamSession.start(
            llm, [*INSTRUCT, 60, 61], list(range(2000, 2017)), generator=torch.Generator().manual_seed(5)
        )
        emitted: list[int] = []
        for delta in deltas:
            session.push_text(delta)
            run_until_blocked(session, emitted, force=False)
        session.end_text()
        for _ in range(10):  # the start of the final phase (sampled until a stop id: up to 360 steps)
            if (token := session.step()) is not None:
                emitted.append(token)
        return emitted, coalesce(session.fed)

    whole = speak([text])
    assert len(whole[0]) >= 45  # 20 text tokens: 4 groups spoken before the text ended
    assert speak(cut(text, cuts)) == whole


def test_short_text_equals_the_whole_text_run(llm):
    """Fewer than 5 text tokens and no prompt speech: [sos, instruct, text, task_id] either way."""
    text = [70, 71, 72]
    forced = [5, 6, 7, 8, 9, 10]
    session = BistreamSession.start(llm, list(INSTRUCT), [], sampling="greedy")
    session.push_text(text)
    assert session.needs_text and session.step() is None  # the text has not ended: nothing to say yet
    session.end_text()
    uni = llm.prefill(text, list(INSTRUCT), [], sampling="greedy")
    for token in forced:
        assert session.step(force=token) == token and llm.step(uni, force=token) == token
        assert_close(session.logits, uni.logits, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        layout = embed_segments(llm, session.fed)
        assert_close(layout[:, : 1 + len(INSTRUCT) + len(text) + 1], llm.lm_input(text, list(INSTRUCT), []))


def test_before_the_text_ends_only_speech_and_fill_are_sampled(llm):
    session = BistreamSession.start(llm, list(INSTRUCT), [], generator=torch.Generator().manual_seed(1))
    session.push_text(list(range(500, 520)))
    emitted: list[int] = []
    run_until_blocked(session, emitted, force=False)
    assert len(emitted) == 60 and all(t < 6561 for t in emitted)
    assert [i for i, t in enumerate(session.out_tokens) if t == FILL_ID] == [15, 31, 47, 63]


def test_batched_v3_sessions_equal_each_alone(llm):
    """Two v3 sessions (one with prompt speech) decoded in one batch on the slot KV cache == alone."""
    from voicertc.backends.cosyvoice.llm.batch import decode_batch
    from voicertc.backends.cosyvoice.llm.kv import SlotKV

    def start(n: int, kv=None) -> BistreamSession:
        session = BistreamSession.start(
            llm, [*INSTRUCT, 60 + n], list(range(2000, 2000 + 7 * n)),
            generator=torch.Generator().manual_seed(20 + n), kv=kv,
        )  # fmt: skip
        session.push_text(list(range(400, 412 + 5 * n)))
        session.end_text()
        return session

    alone = []
    for n in range(2):
        session, tokens = start(n), []
        while not session.finished and len(tokens) < 50:
            tokens.append(session.step())
        alone.append(tokens)
    pool = SlotKV(llm.llm.model.model, slots=2, capacity=16)
    sessions, got = [start(n, pool.acquire()) for n in range(2)], [[], []]
    while any(not s.finished and len(got[n]) < 50 for n, s in enumerate(sessions)):
        live = [n for n in range(2) if not sessions[n].finished and len(got[n]) < 50]
        for n, token in zip(live, decode_batch(llm, [sessions[n] for n in live]), strict=True):
            assert not isinstance(token, BaseException)
            got[n].append(token)
    assert got == alone and all(len([t for t in g if t is not None]) >= 30 for g in got)
