"""`[engine] compile` with `cuda_graphs` for the flow: the captured estimator step compiled by inductor
(`CapturedEstimator(compile=True)`), checked on CPU where inductor compiles the same graph to C++.

Compiled, the static steps must still equal the eager estimator over a streamed utterance (three
chunk lengths, a growing history) and over two utterances at different positions with pad rows, and
every bucket must share one compile (every dimension symbolic; buckets made under inference mode, as
while calls speak, hold the same kind of buffers), so warm-up compiles once however many buckets it
captures."""

from __future__ import annotations

import torch
from flow_stream_helpers import stream_golden, two_utterances
from torch._dynamo.utils import counters

from voicertc.backends.cosyvoice.flow.captured import Buckets, CapturedEstimator
from voicertc.backends.cosyvoice.flow.graph import StreamingEstimator

TOL = 1e-5
HOPS = [25, 50]


class CountingCapture:
    """The compiled step run at each call, its captures counted: a compiled step cannot be recorded
    by `accel.tape.TapeCapture` (dynamo compiles nothing under a dispatch mode)."""

    def __init__(self) -> None:
        self.captured = 0

    def __call__(self, step):
        self.captured += 1
        return step


def test_compiled_static_steps_equal_the_eager_estimator_with_one_compile(flow, tts_golden):
    flow.decoder.estimator_runner = None
    eager_stream = stream_golden(flow, tts_golden, HOPS)
    eager_pair = two_utterances(flow, tts_golden)
    capture = CountingCapture()
    runner = CapturedEstimator(
        StreamingEstimator(flow.decoder.estimator),
        buckets=Buckets(max_rows=8, key_quantum=64),
        capture=capture,
        compile=True,
    )
    graphs_before = counters["stats"]["unique_graphs"]
    flow.decoder.estimator_runner = runner
    try:
        got_stream = stream_golden(flow, tts_golden, HOPS)
        with torch.inference_mode():  # as the engine serves: the 4-row buckets are made in inference mode
            got_pair = two_utterances(flow, tts_golden)
    finally:
        flow.decoder.estimator_runner = None
    assert got_stream.shape == eager_stream.shape
    assert (got_stream - eager_stream).abs().max().item() <= TOL
    for e, g in zip(eager_pair, got_pair, strict=True):
        assert (g - e).abs().max().item() <= TOL
    shapes = runner.stats.by_shape
    assert len(shapes) >= 4 and any(key[0] == 4 for key in shapes)  # frames, keys and rows buckets
    assert capture.captured == len(shapes) and runner.stats.eager == 0
    assert counters["stats"]["unique_graphs"] - graphs_before == 1  # one compile for every bucket
