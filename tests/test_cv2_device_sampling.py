"""Tokens drawn on the device for a whole decode batch (`sampling.draw_rows`, the decode graphs' path):
the nucleus is the host rule's (`nucleus_size`) on any distribution, the batched draw is each row's
`draw_one` on its generator, a row's token does not depend on the rows beside it (each its own
generator), bans hold, and RAS's repetition rule still redraws."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from voicertc.backends.cosyvoice.accel.tape import TapeCapture
from voicertc.backends.cosyvoice.llm.batch import decode_batch
from voicertc.backends.cosyvoice.llm.graphs import DecodeGraphs
from voicertc.backends.cosyvoice.llm.kv import SlotKV
from voicertc.backends.cosyvoice.llm.sampling import (
    SamplingParams,
    draw_one,
    draw_rows,
    nucleus_size,
    ras_repeats,
)
from voicertc.backends.cosyvoice.load.v2 import load_llm

PARAMS = SamplingParams()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), sharpness=st.floats(0.1, 8.0))
def test_the_device_nucleus_is_the_host_rule(seed, sharpness):
    gen = torch.Generator().manual_seed(seed)
    logits = sharpness * torch.randn(3, 300, generator=gen)
    picks = set()
    for draw in range(40):
        gens = [torch.Generator().manual_seed(seed + 7 * draw + b) for b in range(3)]
        picks.update(
            (b, t) for b, t in enumerate(draw_rows(logits, ["ras"] * 3, [()] * 3, PARAMS, gens).tolist())
        )
    for b in range(3):
        probs, ids = logits[b].float().log_softmax(-1).softmax(-1).sort(descending=True, stable=True)
        nucleus = set(ids[: nucleus_size(probs, PARAMS.top_p, PARAMS.top_k)].tolist())
        drawn = {t for row, t in picks if row == b}
        assert drawn <= nucleus  # never outside the host rule's nucleus
        if len(nucleus) == 1:
            assert drawn == nucleus


def test_a_rows_token_does_not_depend_on_the_rows_beside_it_and_bans_hold():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=gen)
    logits[2, 7] = 50.0  # row 2 would always draw 7 ...
    bans = [(), (), (7,), ()]  # ... but 7 is banned there

    def gens():
        return [torch.Generator().manual_seed(100 + b) for b in range(4)]

    together = draw_rows(logits, ["ras", "ras", "ras", "greedy"], bans, PARAMS, gens()).tolist()
    alone = [
        draw_rows(logits[b : b + 1], [m], [bans[b]], PARAMS, [gens()[b]]).item()
        for b, m in enumerate(["ras", "ras", "ras", "greedy"])
    ]
    assert together == alone and together[2] != 7 and together[3] == int(logits[3].argmax())


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.lists(st.tuples(st.sampled_from(["ras", "greedy"]), st.booleans()), min_size=1, max_size=6),
    sharpness=st.floats(0.1, 8.0),
)
def test_the_batched_draw_is_each_rows_draw_one_on_its_generator(seed, rows, sharpness):
    """The bans and the divide / argmax / gather of every row at once: the same ids as each row's ban
    and `draw_one` (which is `multinomial`'s draw, `tests/test_draw_one.py`), each generator left in the
    same state."""
    modes = [mode for mode, _ in rows]
    bans = [(0, 1, 2) if banned else () for _, banned in rows]
    logits = sharpness * torch.randn(len(modes), 300, generator=torch.Generator().manual_seed(seed))
    logits[:, 1] += 20.0  # a banned id that would win

    def gens():
        return [torch.Generator().manual_seed(seed + 11 * b) for b in range(len(modes))]

    batched_gens, row_gens = gens(), gens()
    got = draw_rows(logits, modes, bans, PARAMS, batched_gens).tolist()
    logp = logits.float().log_softmax(-1)
    for b, ban in enumerate(bans):
        logp[b, list(ban)] = -float("inf")
    probs, ids = logp.softmax(-1).sort(dim=-1, descending=True, stable=True)
    head = probs[:, : PARAMS.top_k]
    weights = head * ((head.cumsum(-1) - head) < PARAMS.top_p)
    expected = [
        int(logp[b].argmax()) if mode == "greedy" else int(ids[b, draw_one(weights[b], row_gens[b])])
        for b, mode in enumerate(modes)
    ]
    assert got == expected and not any(got[b] in ban for b, ban in enumerate(bans))
    for a, b in zip(batched_gens, row_gens, strict=True):
        assert torch.equal(a.get_state(), b.get_state())


def test_ras_repetition_rule():
    assert ras_repeats(5, [1, 5, 2, 3, 4, 6, 7, 8, 9, 0], PARAMS)  # once in the last 10 >= 10 * 0.1
    assert not ras_repeats(5, [5, 1, 2, 3, 4, 6, 7, 8, 9, 0, 1], PARAMS)  # out of the window


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return load_llm(tiny_model_dir)


def test_ras_sessions_decoded_together_draw_what_each_draws_alone(llm):
    backbone = llm.llm.model.model
    texts = [[5, 9, 2, 4], [7, 1, 3, 8, 4, 6], [3, 3, 1]]

    def run(groups: list[list[int]]) -> dict[int, list]:
        pool = SlotKV(backbone, slots=8, capacity=64)
        graphs = DecodeGraphs(pool, llm.llm_decoder, max_rows=4, capture=TapeCapture())
        sessions = {
            i: llm.prefill(
                texts[i], sampling="ras", generator=torch.Generator().manual_seed(i), kv=pool.acquire()
            )
            for group in groups
            for i in group
        }
        out: dict[int, list] = {i: [] for i in sessions}
        for group in groups:
            for _ in range(12):
                for i, token in zip(
                    group, decode_batch(llm, [sessions[i] for i in group], graphs), strict=True
                ):
                    out[i].append(token)
        return out

    together = run([[0, 1, 2]])
    alone = run([[0], [1], [2]])
    assert together == alone
    assert any(t is not None for row in together.values() for t in row)
