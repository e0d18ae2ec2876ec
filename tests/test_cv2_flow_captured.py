"""The flow estimator as static-shape steps (what `[engine] cuda_graphs` captures on CUDA): the padded
static step equals the eager estimator (pad rows, cached keys padded to a bucket and hidden, several
utterances at different positions), a whole streamed utterance equals the eager one, and the bucket
logic (choice, one capture per shape, eager fallback outside the buckets or past the memory bound)."""

from __future__ import annotations

import pytest
import torch
from flow_stream_helpers import stream_golden, two_utterances

from voicertc.backends.cosyvoice.accel.flow_onnx_export import example_inputs
from voicertc.backends.cosyvoice.accel.tape import TapeCapture, no_host_syncs
from voicertc.backends.cosyvoice.flow.captured import Buckets, CapturedEstimator, StepShape
from voicertc.backends.cosyvoice.flow.flow import CausalFlow
from voicertc.backends.cosyvoice.flow.graph import StreamingEstimator

TOL = 1e-5


def test_bucket_choice_is_pure_and_pads_rows_frames_and_keys_up():
    buckets = Buckets(max_rows=16, key_quantum=64, max_keys=512, frame_buckets=(64, 128, 256))
    assert buckets.shape(2, 50, 0) == StepShape(rows=2, frames=64, keys=64)
    assert buckets.shape(3, 65, 65) == StepShape(rows=4, frames=128, keys=128)
    assert buckets.shape(6, 100, 129) == StepShape(rows=8, frames=128, keys=256)
    assert buckets.shape(16, 37, 512) == StepShape(rows=16, frames=64, keys=512)
    assert buckets.shape(2, 257, 300) == StepShape(rows=2, frames=512, keys=512)  # multiples of the last
    assert buckets.keys_list(1000) == [64, 128, 256, 512] and buckets.keys_list(100) == [64]
    assert buckets.shape(17, 50, 10) is None  # more rows than the largest bucket
    assert buckets.shape(2, 50, 513) is None  # a history past the largest key bucket
    assert buckets.rows_list() == [2, 4, 8, 16]
    assert Buckets(max_rows=12).rows_list() == [2, 4, 8, 12]
    assert Buckets(max_rows=12).shape(9, 50, 1).rows == 12


def _with_runner(flow: CausalFlow, runner, run):
    flow.decoder.estimator_runner = runner
    try:
        return run()
    finally:
        flow.decoder.estimator_runner = None


HOPS = [25, 50]  # + the final chunk: three chunk lengths, a growing history


@pytest.fixture(scope="module")
def eager_stream(flow, tts_golden):
    flow.decoder.estimator_runner = None
    return stream_golden(flow, tts_golden, HOPS)


def test_a_streamed_utterance_through_static_steps_equals_the_eager_one(flow, tts_golden, eager_stream):
    capture = TapeCapture()
    runner = CapturedEstimator(
        StreamingEstimator(flow.decoder.estimator),
        buckets=Buckets(max_rows=8, key_quantum=64),
        capture=capture,
    )
    with no_host_syncs():  # a chunk's steps only queue work (no `.item()`, no mask's nonzero)
        got = _with_runner(flow, runner, lambda: stream_golden(flow, tts_golden, HOPS))
    assert got.shape == eager_stream.shape and eager_stream.shape[2] > 150
    assert (got - eager_stream).abs().max().item() <= TOL
    steps = runner.stats.replays + runner.stats.eager
    assert runner.stats.replays > 0 and capture.replays == runner.stats.replays
    assert capture.captured == len(runner.stats.by_shape) < steps  # a bucket is captured once, replayed often
    assert all(
        key[0] == 2 and key[7][3] - key[1][1] in (64, 128, 256, 512) for key in runner.stats.by_shape
    )  # rows; kv keys: the cached keys' bucket and room for the chunk's frames (x [80, frames])
    assert all(key[1][1] in (64, 128, 256) for key in runner.stats.by_shape)  # padded chunk frames


def test_pad_rows_and_utterances_at_different_positions_equal_eager(flow, tts_golden):
    flow.decoder.estimator_runner = None
    eager = two_utterances(flow, tts_golden)
    runner = CapturedEstimator(
        StreamingEstimator(flow.decoder.estimator), buckets=Buckets(max_rows=8), capture=TapeCapture()
    )
    got = _with_runner(flow, runner, lambda: two_utterances(flow, tts_golden))
    for e, g in zip(eager, got, strict=True):
        assert (g - e).abs().max().item() <= TOL
    assert any(key[0] == 4 for key in runner.stats.by_shape)  # the two-utterance batch


NAMES = ("x", "mu", "t", "spks", "cond", "conv_cache", "kv_cache", "attn_bias")


def test_three_utterances_run_in_a_four_utterance_bucket_with_pad_rows(flow):
    module = StreamingEstimator(flow.decoder.estimator)
    inputs = dict(zip(NAMES, example_inputs(module.layout, rows=6, frames=20, cached=64), strict=True))
    expected = module(*inputs.values())
    runner = CapturedEstimator(module, buckets=Buckets(max_rows=8, key_quantum=64))
    got = runner.run(inputs)
    assert [key[0] for key in runner.stats.by_shape] == [8]  # 6 rows (3 utterances) padded to 8
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=0, atol=TOL)


def test_outside_every_bucket_or_past_the_memory_bound_runs_eagerly_and_is_counted(flow):
    module = StreamingEstimator(flow.decoder.estimator)
    inputs = dict(zip(NAMES, example_inputs(module.layout, rows=2, frames=20, cached=64), strict=True))
    expected = module(*inputs.values())

    capture = TapeCapture()
    fits = CapturedEstimator(module, buckets=Buckets(max_rows=8, key_quantum=64), capture=capture)
    for got, want in zip(fits.run(inputs), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    assert capture.captured == 1 and fits.stats.replays == 1 and fits.stats.eager == 0

    long_history = CapturedEstimator(module, buckets=Buckets(max_rows=8, key_quantum=32, max_keys=32))
    too_many_rows = CapturedEstimator(module, buckets=Buckets(max_rows=1))
    starved = CapturedEstimator(module, buckets=Buckets(max_rows=8), capture=capture, memory_mb=0.001)
    for runner in (long_history, too_many_rows, starved):
        for got, want in zip(runner.run(inputs), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=TOL)
        assert runner.stats.eager == 1 and runner.stats.replays == 0 and runner.stats.bytes == 0
    assert capture.captured == 1  # nothing captured past the budget
