"""`StaticSteps` (the captured-steps mechanism, run without capture on CPU): results equal the eager
step for every bucket; a step writes into static output buffers shared by the buckets (contiguous
views of the largest's first elements), so a graph's own allocations are intermediates; a bucket past
the budget allocates nothing."""

from __future__ import annotations

import torch

from voicertc.backends.cosyvoice.accel.captured import GraphBudget, StaticSteps


def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # rows on dim 0 of x and dim 1 of y; the outputs keep x's rows on dim 0
    return x * 2.0 + y.sum(dim=0)[:, None], x.mean(dim=1, keepdim=True)


class CountingCapture:
    """A "capture" that runs the static step each time, and remembers the steps it was given."""

    def __init__(self) -> None:
        self.steps: list = []

    def __call__(self, fn):
        self.steps.append(fn)
        return fn


def inputs(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=gen), torch.randn(3, rows, generator=gen)


def test_buckets_equal_the_eager_step_and_share_static_outputs():
    capture = CountingCapture()
    steps = StaticSteps("test", step, in_row_dims=(0, 1), out_row_dims=(0, 0), capture=capture)
    for rows, padded in ((7, 8), (3, 4), (8, 8), (1, 1)):
        x, y = inputs(rows, seed=rows)
        got = steps.run(padded, [x, y])
        assert got is not None
        for g, e in zip(got, step(x, y), strict=True):
            assert torch.allclose(g, e)
    assert len(capture.steps) == 3  # buckets of 8, 4 and 1 rows
    assert len(steps._out_buffers) == 2  # one buffer per output position: the 8-row bucket's
    big = {i: t for (i, _, _), t in steps._out_buffers.items()}
    for fn in capture.steps:
        for i, out in enumerate(fn()):
            assert out.untyped_storage().data_ptr() == big[i].untyped_storage().data_ptr()
            assert out.is_contiguous()  # a compiled step's stride assumptions hold in every bucket
    assert all(x.is_contiguous() for bucket in steps._buckets.values() for x in bucket.inputs)


def test_a_bucket_past_the_budget_allocates_nothing_and_runs_eagerly():
    steps = StaticSteps(
        "test", step, in_row_dims=(0, 1), out_row_dims=(0, 0), budget=GraphBudget(limit_bytes=64)
    )
    x, y = inputs(16, seed=1)
    assert steps.run(16, [x, y]) is None
    assert steps._buffers == {} and steps._out_buffers == {}
    assert steps.stats.eager == 1 and steps.stats.captures == 0


def test_buckets_made_under_inference_mode_hold_ordinary_tensors():
    """A bucket made while calls speak (inference mode) holds the same kind of buffers as one made at
    warm-up: a compiled step guards on the kind, and would compile again on the engine thread."""
    steps = StaticSteps("test", step, in_row_dims=(0, 1), out_row_dims=(0, 0))
    x, y = inputs(2, seed=2)
    steps.run(2, [x, y])
    with torch.inference_mode():
        x, y = inputs(8, seed=3)  # larger: new buffers, made in inference mode
        got = steps.run(8, [x, y])
    assert got is not None and len(steps._buffers) == 4
    buffers = [*steps._buffers.values(), *steps._out_buffers.values()]
    assert not any(b.is_inference() for b in buffers)


def test_sealed_a_bucket_that_would_compile_again_runs_uncompiled_and_is_counted():
    """`compile=True`: every bucket shares one compile; after `seal` (warm-up over) a bucket whose
    inputs would make it compile again (other dtypes here) is made from the uncompiled step."""
    from torch._dynamo.utils import counters

    steps = StaticSteps("test", step, in_row_dims=(0, 1), out_row_dims=(0, 0), compile=True)
    for rows in (2, 4):
        x, y = inputs(rows, seed=rows)
        got = steps.run(rows, [x, y])
        assert got is not None and all(torch.allclose(g, e) for g, e in zip(got, step(x, y), strict=True))
    steps.seal()
    graphs_before = counters["stats"]["unique_graphs"]
    x, y = (t.double() for t in inputs(8, seed=8))
    got = steps.run(8, [x, y])
    assert got is not None and all(torch.allclose(g, e) for g, e in zip(got, step(x, y), strict=True))
    assert counters["stats"]["unique_graphs"] == graphs_before
    assert steps.stats.uncompiled == 1 and steps.stats.captures == 3
