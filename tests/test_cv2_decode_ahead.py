"""Decoding ahead (`llm.ahead`, the decode graphs' path): a step launched before the one before is read
draws exactly the tokens of step-by-step decoding (RAS with the token in flight in its window, the
min_len ban, the end of speech with the launched step after it dropped, max_len); RAS on the device
(`sampling.ras_on_device`) redraws what repeats, and moves each row's generator the same whatever it
draws; bad launches are refused."""

from __future__ import annotations

import pytest
import torch
from decode_helpers import decode_ahead, decode_stepped

from voicertc.backends.cosyvoice.accel.tape import TapeCapture
from voicertc.backends.cosyvoice.llm.ahead import launch, read
from voicertc.backends.cosyvoice.llm.graphs import DecodeGraphs
from voicertc.backends.cosyvoice.llm.kv import SlotKV
from voicertc.backends.cosyvoice.llm.qwen2lm import EOS_ID, LlmSession, Qwen2LM
from voicertc.backends.cosyvoice.llm.sampling import SamplingParams, draw_rows
from voicertc.backends.cosyvoice.load.v2 import load_llm

TEXTS = [[5, 9, 2, 4], [7, 1, 3, 8, 4, 6], [3, 3, 1], [2, 6, 6, 1, 9]]
PARAMS = SamplingParams()


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> Qwen2LM:
    return load_llm(tiny_model_dir)


def _sessions(llm: Qwen2LM, pool: SlotKV) -> list[LlmSession]:
    """Three RAS sessions and a greedy one; one ends at a max_len of 7."""
    sessions = [
        llm.prefill(
            text,
            sampling="greedy" if i == 3 else "ras",
            generator=torch.Generator().manual_seed(40 + i),
            kv=pool.acquire(),
        )
        for i, text in enumerate(TEXTS)
    ]
    sessions[2].max_len = 7
    return sessions


def _decode(how, llm: Qwen2LM, pool: SlotKV, graphs: DecodeGraphs):  # noqa: ANN001, ANN202
    return how(llm, graphs, _sessions(llm, pool))


def _ending_llm(llm: Qwen2LM, tiny_model_dir) -> Qwen2LM:
    """The tiny LLM with the end of speech made likely: RAS sessions end soon after min_len."""
    ending = load_llm(tiny_model_dir)
    with torch.no_grad():
        ending.llm_decoder.bias[EOS_ID] += 30.0
    return ending


@pytest.mark.parametrize("ends", [False, True], ids=["max-len", "end-of-speech"])
def test_launching_ahead_draws_the_tokens_of_step_by_step_decoding(llm, tiny_model_dir, ends):
    model = _ending_llm(llm, tiny_model_dir) if ends else llm
    backbone = model.llm.model.model

    def graphs() -> tuple[SlotKV, DecodeGraphs]:
        pool = SlotKV(backbone, slots=8, capacity=64)
        return pool, DecodeGraphs(pool, model.llm_decoder, max_rows=4, capture=TapeCapture())

    expected = _decode(decode_stepped, model, *graphs())
    got, behind, dropped = _decode(decode_ahead, model, *graphs())
    assert got == expected
    assert behind >= 5  # the steps did run ahead
    assert len(expected[2]) == 7  # max_len
    min_lens = [2 * len(text) for text in TEXTS]
    assert all(len(row) >= n for row, n in zip(expected, min_lens, strict=True))  # EOS banned before
    if ends:  # an end of speech read one step late: the step launched after it is dropped
        assert any(
            len(row) < 20 * len(t) for row, t in zip(expected, TEXTS, strict=True) if row != expected[2]
        )
        assert dropped >= 1
    else:
        assert dropped == 0 and [len(r) for r in expected] == [80, 120, 7, 100]


def test_the_token_in_flight_is_in_the_repetition_window(llm, tiny_model_dir):
    """A session that would draw one id at every step: RAS keeps it once, then redraws it while it is
    in the last 10 ids, including the step after, launched before that id was read."""
    model = load_llm(tiny_model_dir)
    with torch.no_grad():
        model.llm_decoder.bias[123] += 40.0
    pool = SlotKV(model.llm.model.model, slots=4, capacity=64)
    graphs = DecodeGraphs(pool, model.llm_decoder, max_rows=2, capture=TapeCapture())
    session = model.prefill(
        TEXTS[0], sampling="ras", generator=torch.Generator().manual_seed(1), kv=pool.acquire()
    )
    first = launch(model, graphs, [session])
    second = launch(model, graphs, [session], first)  # before `first` is read
    assert session.unread == 2 and session.out_tokens == []
    assert read(model, first) == [123]
    assert read(model, second)[0] not in (123, None)
    third = launch(model, graphs, [session])
    assert read(model, third)[0] != 123  # still in the window
    # a step of fewer sessions than the one before (another left): each takes its own window from it
    a, b = (
        model.prefill(TEXTS[1], sampling="ras", generator=torch.Generator().manual_seed(s), kv=pool.acquire())
        for s in (2, 3)
    )
    both = launch(model, graphs, [a, b])
    second_of_b = launch(model, graphs, [b], both)
    assert read(model, both) == [123, 123] and read(model, second_of_b)[0] not in (123, None)


def test_ras_on_the_device_redraws_a_repeat_and_moves_every_generator_alike():
    logits = torch.full((3, 40), -5.0)
    logits[:, 7] = 30.0  # every row draws 7 from the nucleus
    recent = torch.tensor([[-1] * 9 + [7], [1, 2, 3, 4, 5, 6, 8, 9, 10, 11], [7] + [-1] * 9])

    def gens():
        return [torch.Generator().manual_seed(9) for _ in range(3)]

    got_gens = gens()
    got = draw_rows(logits, ["ras"] * 3, [()] * 3, PARAMS, got_gens, recent=recent).tolist()
    assert got[0] != 7 and got[1] == 7 and got[2] != 7  # a repeat anywhere in the window is redrawn
    states = [g.get_state() for g in got_gens]
    assert all(torch.equal(states[0], s) for s in states)  # redrawn or not: the same draws made
    alone = [
        draw_rows(logits[b : b + 1], ["ras"], [()], PARAMS, [gens()[b]], recent=recent[b : b + 1]).item()
        for b in range(3)
    ]
    assert alone == got
    greedy = draw_rows(logits, ["greedy"] * 3, [()] * 3, PARAMS, gens(), recent=recent).tolist()
    assert greedy == [7, 7, 7]  # RAS is the sampler's rule: greedy rows never redraw


def test_bad_launches_and_reads_are_refused(llm):
    pool = SlotKV(llm.llm.model.model, slots=4, capacity=64)
    graphs = DecodeGraphs(pool, llm.llm_decoder, max_rows=2, capture=TapeCapture())
    session = llm.prefill(TEXTS[0], sampling="greedy", kv=pool.acquire())
    with pytest.raises(ValueError, match="no sessions"):
        launch(llm, graphs, [])
    step = launch(llm, graphs, [session])
    with pytest.raises(ValueError, match="launch on from that step"):
        launch(llm, graphs, [session])  # its input is `step`'s token: `before` must be given
    read(llm, step)
    with pytest.raises(ValueError, match="read already"):
        read(llm, step)
    session.finished = True
    with pytest.raises(ValueError, match="cannot take a step"):
        launch(llm, graphs, [session])


def test_cosyvoice3s_llm_launched_ahead_draws_its_step_by_step_tokens(cv3_model, cv3_records):
    """v3's LLM (200 stop ids, its own embedding table) on the same path: ahead == step by step."""
    llm = cv3_model.llm
    rec = cv3_records("llm_tiny.safetensors")
    inputs = (rec["in_text"], rec["in_prompt_text"], rec["in_prompt_speech_token"])

    def run(ahead: bool) -> list[list[int]]:
        pool = SlotKV(llm.llm.model.model, slots=4, capacity=128)
        graphs = DecodeGraphs(pool, llm.llm_decoder, max_rows=2, capture=TapeCapture())
        sessions = [
            llm.prefill(*inputs, generator=torch.Generator().manual_seed(s), kv=pool.acquire())
            for s in (3, 4)
        ]
        for session in sessions:
            session.max_len = 30
        return decode_ahead(llm, graphs, sessions)[0] if ahead else decode_stepped(llm, graphs, sessions)

    expected = run(ahead=False)
    assert run(ahead=True) == expected and all(len(tokens) > 0 for tokens in expected)
