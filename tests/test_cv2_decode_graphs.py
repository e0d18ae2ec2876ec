"""The static-shape decode step behind `[engine] cuda_graphs` (decode_graphs.DecodeGraphs) on CPU.

On a CPU the padded step (over its span bucket of positions) runs eagerly without capture; it must
give the logits of `SlotKV.forward` (the batched==unbatched reference) for any batch size, pad the rest
of its bucket into a scratch row no utterance owns, read no key past its span, and survive the pool
growing under it. The capture/replay itself is checked on CUDA (tests/test_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from voicertc.backends.cosyvoice.accel.tape import TapeCapture
from voicertc.backends.cosyvoice.llm.graphs import (
    DecodeGraphs,
    batch_buckets,
    bucket_for,
    span_for,
    spans_up_to,
)
from voicertc.backends.cosyvoice.llm.kv import SlotKV
from voicertc.backends.cosyvoice.load.v2 import load_llm


def test_buckets_cover_every_batch_size():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(16) == (1, 2, 4, 8, 16)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 32)
    buckets = batch_buckets(20)
    for rows in range(1, 33):
        bucket = bucket_for(rows, buckets)
        assert bucket is not None and bucket >= rows and (bucket == 1 or bucket // 2 < rows)
    assert bucket_for(33, buckets) is None


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return load_llm(tiny_model_dir)


def _prefilled(pool: SlotKV, llm, lengths: list[int], seed: int):
    """Slots filled with `lengths[i]` random positions each (same contents for the same seed)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = llm.llm.model.model.config.hidden_size
    slots = []
    for n in lengths:
        slot = pool.acquire()
        slot.feed(torch.randn(1, n, hidden, generator=gen))
        slots.append(slot)
    return slots


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_static_step_matches_the_eager_batched_step(llm, rows):
    backbone, head = llm.llm.model.model, llm.llm_decoder
    hidden = backbone.config.hidden_size
    lengths = [7 + 5 * i for i in range(rows)]
    eager_pool, static_pool = SlotKV(backbone, slots=8, capacity=64), SlotKV(backbone, slots=8, capacity=64)
    graphs = DecodeGraphs(static_pool, head, max_rows=8, capture=TapeCapture())
    eager_rows = _prefilled(eager_pool, llm, lengths, seed=1)
    static_rows = _prefilled(static_pool, llm, lengths, seed=1)
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        embeds = torch.randn(rows, 1, hidden, generator=gen)
        expected = head(eager_pool.forward(eager_rows, embeds)[:, -1])
        got = graphs.logits(static_rows, embeds)
        assert got.shape == expected.shape
        assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert [r.length for r in static_rows] == [n + 4 for n in lengths]
    # the pad rows wrote only into the scratch row: every owned row equals the eager pool's
    for e, s in zip(eager_rows, static_rows, strict=True):
        assert_close(static_pool.k[:, s.index, :, : s.length], eager_pool.k[:, e.index, :, : e.length])
    assert graphs.scratch.index not in {r.index for r in static_rows}
    assert graphs.captures == 0 and graphs.replays == 4  # CPU: the static step, never a capture


def test_the_pool_growing_under_the_steps_keeps_them_exact(llm):
    backbone, head = llm.llm.model.model, llm.llm_decoder
    hidden = backbone.config.hidden_size
    eager_pool, static_pool = SlotKV(backbone, slots=2, capacity=16), SlotKV(backbone, slots=2, capacity=16)
    graphs = DecodeGraphs(static_pool, head, max_rows=4, capture=TapeCapture())
    eager_rows = _prefilled(eager_pool, llm, [14, 3], seed=3)
    static_rows = _prefilled(static_pool, llm, [14, 3], seed=3)  # the scratch row made it grow to 4 slots
    assert static_pool.slots == 4
    gen = torch.Generator().manual_seed(4)
    before = static_pool.generation
    for _ in range(5):  # row 0 passes the capacity of 16: the pool doubles its positions
        embeds = torch.randn(2, 1, hidden, generator=gen)
        expected = head(eager_pool.forward(eager_rows, embeds)[:, -1])
        assert_close(graphs.logits(static_rows, embeds), expected, atol=1e-5, rtol=1e-5)
    assert static_pool.capacity == 32 and static_pool.generation != before


def test_more_rows_than_the_largest_bucket_decode_eagerly(llm):
    backbone, head = llm.llm.model.model, llm.llm_decoder
    hidden = backbone.config.hidden_size
    eager_pool, static_pool = SlotKV(backbone, slots=8, capacity=32), SlotKV(backbone, slots=8, capacity=32)
    graphs = DecodeGraphs(static_pool, head, max_rows=2, capture=TapeCapture())
    eager_rows = _prefilled(eager_pool, llm, [4, 5, 6], seed=5)
    static_rows = _prefilled(static_pool, llm, [4, 5, 6], seed=5)
    embeds = torch.randn(3, 1, hidden, generator=torch.Generator().manual_seed(6))
    expected = head(eager_pool.forward(eager_rows, embeds)[:, -1])
    assert_close(graphs.logits(static_rows, embeds), expected, atol=1e-5, rtol=1e-5)
    assert graphs.replays == 0


def test_bad_steps_are_refused(llm):
    backbone, head = llm.llm.model.model, llm.llm_decoder
    pool = SlotKV(backbone, slots=4, capacity=16)
    graphs = DecodeGraphs(pool, head, max_rows=4, capture=TapeCapture())
    slot = pool.acquire()
    hidden = backbone.config.hidden_size
    with pytest.raises(ValueError, match=r"\[B, 1, H\]"):
        graphs.logits([slot], torch.zeros(1, 2, hidden))
    slot.release()
    with pytest.raises(ValueError, match="released"):
        graphs.logits([slot], torch.zeros(1, 1, hidden))
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(pool, head, max_rows=4, capture=True)


def test_spans_double_from_the_quantum_up_to_the_capacity():
    assert span_for(1, 256, 2048) == 256 and span_for(256, 256, 2048) == 256
    assert span_for(257, 256, 2048) == 512 and span_for(1500, 256, 2048) == 2048
    assert span_for(300, 256, 300) == 300 and span_for(10, 256, 64) == 64  # never past the pool
    assert spans_up_to(256, 2048) == [256, 512, 1024, 2048]
    assert spans_up_to(256, 3000) == [256, 512, 1024, 2048, 3000] and spans_up_to(256, 64) == [64]


def test_a_step_attends_over_its_rows_span_not_the_capacity_and_stays_exact(llm):
    """Rows growing across span buckets (8, 16, 32, then the capacity of 64): each step runs the
    bucket of the longest row's next position and gives the eager step's logits; a step's keys past
    its span are never read (poisoned here: a step that read them would be NaN)."""
    backbone, head = llm.llm.model.model, llm.llm_decoder
    hidden = backbone.config.hidden_size
    eager_pool, static_pool = SlotKV(backbone, slots=4, capacity=64), SlotKV(backbone, slots=4, capacity=64)
    graphs = DecodeGraphs(static_pool, head, max_rows=4, span_quantum=8, capture=TapeCapture())
    eager_rows = _prefilled(eager_pool, llm, [3, 5], seed=5)
    static_rows = _prefilled(static_pool, llm, [3, 5], seed=5)
    gen = torch.Generator().manual_seed(6)
    spans = []
    for _ in range(40):
        longest = max(r.length for r in static_rows)
        span = span_for(longest + 1, 8, static_pool.capacity)
        for cache in (*static_pool.keys, *static_pool.values):  # masked inside the span, never read past it
            for row in static_rows:
                cache[row.index, :, row.length : span] = 0.0
            cache[:, :, span:] = float("nan")
        embeds = torch.randn(2, 1, hidden, generator=gen)
        expected = head(eager_pool.forward(eager_rows, embeds)[:, -1])
        assert_close(graphs.logits(static_rows, embeds), expected, atol=1e-5, rtol=1e-5)
        spans.append(span)
    assert spans[0] == 8 and sorted(set(spans)) == [8, 16, 32, 64]
    assert {key for key in graphs._steps} == {(2, 8), (2, 16), (2, 32), (2, 64)}


@pytest.mark.parametrize("prompt_lengths", [[9], [9, 30, 17]], ids=["one", "three"])
def test_prompt_steps_equal_feeding_each_prompt_eagerly(llm, prompt_lengths):
    """Prompts (rows already holding a voice's prefix of different lengths) through one padded prompt
    step: each row's last-position logits and its K/V equal feeding its prompt alone, lengths grow by
    the real positions, and the decode steps after them stay exact."""
    backbone, head = llm.llm.model.model, llm.llm_decoder
    hidden = backbone.config.hidden_size
    prefixes = [4 + 3 * i for i in range(len(prompt_lengths))]
    eager_pool, static_pool = SlotKV(backbone, slots=8, capacity=64), SlotKV(backbone, slots=8, capacity=64)
    graphs = DecodeGraphs(static_pool, head, max_rows=4, span_quantum=16, capture=TapeCapture())
    eager_rows = _prefilled(eager_pool, llm, prefixes, seed=7)
    static_rows = _prefilled(static_pool, llm, prefixes, seed=7)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randn(1, n, hidden, generator=gen) for n in prompt_lengths]
    expected = torch.stack([head(row.feed(p)[0, -1]) for row, p in zip(eager_rows, prompts, strict=True)])
    got = graphs.prompt_logits(static_rows, prompts)
    assert got is not None and got.shape == expected.shape
    assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert [r.length for r in static_rows] == [a + b for a, b in zip(prefixes, prompt_lengths, strict=True)]
    for e, s in zip(eager_rows, static_rows, strict=True):
        assert_close(static_pool.k[:, s.index, :, : s.length], eager_pool.k[:, e.index, :, : e.length])
        assert_close(static_pool.v[:, s.index, :, : s.length], eager_pool.v[:, e.index, :, : e.length])
    rows = len(prompts)
    for _ in range(3):  # decoding on: the pad positions past each row's length are never seen
        embeds = torch.randn(rows, 1, hidden, generator=gen)
        want = head(eager_pool.forward(eager_rows, embeds)[:, -1])
        assert_close(graphs.logits(static_rows, embeds), want, atol=1e-5, rtol=1e-5)
    assert {key[1] for key in graphs._prompts} == {32}  # padded to the first prompt bucket
    assert graphs.prompt_eager == 0


def test_a_prompt_past_every_prompt_step_or_the_pool_is_left_to_the_eager_forward(llm):
    backbone, head = llm.llm.model.model, llm.llm_decoder
    pool = SlotKV(backbone, slots=4, capacity=512)
    graphs = DecodeGraphs(pool, head, max_rows=2, capture=TapeCapture())
    row = pool.acquire()
    long = torch.randn(1, 300, backbone.config.hidden_size)
    assert graphs.prompt_logits([row], [long]) is None
    assert graphs.prompt_eager == 1 and row.length == 0  # nothing fed: the caller feeds it
    row.feed(torch.randn(1, 490, backbone.config.hidden_size))  # 22 positions left in the pool
    short = torch.randn(1, 20, backbone.config.hidden_size)  # fits, but its padding (to 32) would not
    assert graphs.prompt_logits([row], [short]) is None
    assert graphs.prompt_eager == 2 and pool.capacity == 512 and row.length == 490


def test_warm_up_makes_every_decode_bucket_and_the_common_prompt_buckets(llm):
    backbone, head = llm.llm.model.model, llm.llm_decoder
    graphs = DecodeGraphs(SlotKV(backbone, slots=4, capacity=512), head, max_rows=16)
    graphs.warm()
    rows = {1, 2, 4, 8, 16}
    assert set(graphs._steps) == {(r, s) for r in rows for s in (256, 512)}
    short = {(r, t, s) for r in rows for t in (32, 64) for s in (256, 512)}
    long = {(r, 128, s) for r in rows if r <= 8 for s in (256, 512)}
    assert set(graphs._prompts) == short | long
