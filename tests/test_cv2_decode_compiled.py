"""`[engine] compile` with `cuda_graphs`: the static decode step compiled by inductor before capture
(`DecodeGraphs(compile=True)`), checked on CPU where inductor compiles the same graph to C++.

The compiled step must give the eager batched step's logits and write the same keys/values into the
pool's own tensors (in place: the pool's per-layer tensors are what a capture holds), and buckets of
two and more rows must share one compile (the batch dimension symbolic), so warm-up compiles twice
whatever `max_batch` is. The capture itself is CUDA's (tests/test_gpu_captured.py).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch.testing import assert_close

from voicertc.backends.cosyvoice.llm.graphs import DecodeGraphs
from voicertc.backends.cosyvoice.llm.kv import SlotKV
from voicertc.backends.cosyvoice.load.v2 import load_llm


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return load_llm(tiny_model_dir)


def _pair(llm, slots: int, capacity: int, max_rows: int, lengths: list[int]):
    """An eager pool and a compiled-step pool with the same rows: (head, hidden size, eager pool, its
    rows, static pool, its rows, the compiled `DecodeGraphs`)."""
    backbone, head = llm.llm.model.model, llm.llm_decoder
    hidden = backbone.config.hidden_size
    eager = SlotKV(backbone, slots=slots, capacity=capacity, fused=True)
    static = SlotKV(backbone, slots=slots, capacity=capacity, fused=True)
    graphs = DecodeGraphs(static, head, max_rows=max_rows, compile=True)
    return head, hidden, eager, _rows(eager, hidden, lengths), static, _rows(static, hidden, lengths), graphs


def _rows(pool: SlotKV, hidden: int, lengths: list[int]):
    gen = torch.Generator().manual_seed(11)
    rows = []
    for n in lengths:
        row = pool.acquire()
        row.feed(torch.randn(1, n, hidden, generator=gen))
        rows.append(row)
    return rows


def test_the_compiled_static_step_is_the_eager_step_and_writes_the_pool_in_place(llm):
    head, hidden, eager, eager_rows, static, static_rows, graphs = _pair(llm, 8, 64, 4, [6, 13, 20])
    layer_keys = list(static.keys)
    graphs_before = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(12)
    for batch in (3, 2, 3, 2):  # buckets 4 and 2: one compile between them
        embeds = torch.randn(batch, 1, hidden, generator=gen)
        expected = head(eager.forward(eager_rows[:batch], embeds)[:, -1])
        got = graphs.logits(static_rows[:batch], embeds)
        assert_close(got, expected, atol=1e-4, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
    assert all(a is b for a, b in zip(static.keys, layer_keys, strict=True))  # written in place
    for e, s in zip(eager_rows, static_rows, strict=True):
        assert s.length == e.length
        assert_close(static.k[:, s.index, :, : s.length], eager.k[:, e.index, :, : e.length])
        assert_close(static.v[:, s.index, :, : s.length], eager.v[:, e.index, :, : e.length])
    assert graphs.captures == 0 and graphs.replays == 4


def test_a_pool_growing_under_the_compiled_step_does_not_compile_it_again(llm):
    """Slots and positions are symbols of the compiled step: growing the pool while calls speak costs
    a capture, not a compile (a minute of the engine thread on a GPU)."""
    head, hidden, eager, eager_rows, static, static_rows, graphs = _pair(llm, 2, 16, 2, [14, 3])
    gen = torch.Generator().manual_seed(13)
    compiles = []
    for _ in range(5):  # the 14-position row passes 16: the pool doubles its capacity
        graphs_before = counters["stats"]["unique_graphs"]
        embeds = torch.randn(2, 1, hidden, generator=gen)
        expected = head(eager.forward(eager_rows, embeds)[:, -1])
        assert_close(graphs.logits(static_rows, embeds), expected, atol=1e-4, rtol=1e-5)
        compiles.append(counters["stats"]["unique_graphs"] - graphs_before)
    assert static.capacity == 32 and static.generation > 0
    # the first step compiles (or reuses this module's compile: the same shapes); the grown pool does not
    assert compiles[0] <= 1 and compiles[1:] == [0, 0, 0, 0]


def test_after_warm_up_a_step_that_would_compile_runs_uncompiled_and_is_counted(llm):
    """Sealed (warm-up over), a bucket never compiled (one row, here: only the 2-row bucket was
    warmed) runs the uncompiled static step instead of holding the engine thread for a compile."""
    head, hidden, eager, eager_rows, static, static_rows, graphs = _pair(llm, 4, 32, 2, [5, 9])
    gen = torch.Generator().manual_seed(14)
    embeds = torch.randn(2, 1, hidden, generator=gen)
    assert_close(graphs.logits(static_rows, embeds), head(eager.forward(eager_rows, embeds)[:, -1]))
    graphs.seal()
    graphs_before = counters["stats"]["unique_graphs"]
    for _ in range(2):
        embeds = torch.randn(1, 1, hidden, generator=gen)
        expected = head(eager.forward(eager_rows[:1], embeds)[:, -1])
        assert_close(graphs.logits(static_rows[:1], embeds), expected, atol=1e-4, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs_before  # nothing compiled after the seal
    assert graphs.uncompiled == 1 and not graphs._steps[(1, 32)].compiled and graphs._steps[(2, 32)].compiled


def test_one_compile_serves_every_key_span(llm):
    """The span a step attends over is a symbol of the compiled step (the length of `key_positions`):
    rows growing across spans 8, 16, 32 and 64 compile once, and every step equals the eager one."""
    backbone, head = llm.llm.model.model, llm.llm_decoder
    hidden = backbone.config.hidden_size
    eager = SlotKV(backbone, slots=4, capacity=64, fused=True)
    static = SlotKV(backbone, slots=4, capacity=64, fused=True)
    graphs = DecodeGraphs(static, head, max_rows=2, compile=True, span_quantum=8)
    eager_rows, static_rows = _rows(eager, hidden, [4, 6]), _rows(static, hidden, [4, 6])
    gen = torch.Generator().manual_seed(15)
    graphs_before = counters["stats"]["unique_graphs"]
    for _ in range(40):
        embeds = torch.randn(2, 1, hidden, generator=gen)
        expected = head(eager.forward(eager_rows, embeds)[:, -1])
        assert_close(graphs.logits(static_rows, embeds), expected, atol=1e-4, rtol=1e-5)
    assert {span for _, span in graphs._steps} == {8, 16, 32, 64}
    assert counters["stats"]["unique_graphs"] - graphs_before <= 1
