"""CosyVoice3's grouped k=31 position convs as one batched matmul (`grouped_conv1d_as_matmul`): the same
function as `F.conv1d` at any shape, and a streamed utterance of the DiT with its convs in that form
equals the `F.conv1d` one (eager and through the static-shape steps). The form exists to be timed
against cuDNN on a GPU (`bench.gpu_flow_probe --v3`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from flow_stream_helpers import stream_golden

from voicertc.backends.cosyvoice.flow import dit
from voicertc.backends.cosyvoice.flow.captured import Buckets, CapturedEstimator
from voicertc.backends.cosyvoice.flow.dit import grouped_conv1d_as_matmul, use_matmul_convs
from voicertc.backends.cosyvoice.flow.graph import StreamingEstimator

HOPS = [25, 50]  # chunks of 29 and 50 tokens from the 21-token prompt (the first padded), then the final


@pytest.mark.parametrize(
    ("batch", "channels", "out_channels", "groups", "kernel", "frames", "bias"),
    [
        (1, 64, 64, 16, 31, 1, True),
        (3, 64, 64, 16, 31, 230, True),
        (2, 48, 24, 4, 5, 17, False),
        (2, 8, 16, 1, 3, 50, True),
        (1, 32, 32, 32, 7, 9, True),  # depthwise
    ],
)
def test_the_matmul_form_is_conv1d(batch, channels, out_channels, groups, kernel, frames, bias):
    g = torch.Generator().manual_seed(frames + groups)
    x = torch.randn(batch, channels, frames + kernel - 1, generator=g, dtype=torch.float64)
    weight = torch.randn(out_channels, channels // groups, kernel, generator=g, dtype=torch.float64)
    b = torch.randn(out_channels, generator=g, dtype=torch.float64) if bias else None
    expected = F.conv1d(x, weight, b, groups=groups)
    got = grouped_conv1d_as_matmul(x, weight, b, groups)
    assert got.shape == expected.shape == (batch, out_channels, frames)
    assert (got - expected).abs().max().item() <= 1e-12
    got32 = grouped_conv1d_as_matmul(x.float(), weight.float(), None if b is None else b.float(), groups)
    assert (got32.double() - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()


@pytest.fixture(scope="module")
def flow(cv3_model):
    return cv3_model.flow


@pytest.fixture(scope="module")
def g(cv3_records):
    return cv3_records("flow_nonstream.safetensors")


def _stream(flow, g) -> torch.Tensor:
    return stream_golden(flow, g, HOPS)


def _matmul_stream(flow, g, runner=None) -> torch.Tensor:
    assert use_matmul_convs(flow.decoder.estimator) == 2
    flow.decoder.estimator_runner = runner
    try:
        return _stream(flow, g)
    finally:
        use_matmul_convs(flow.decoder.estimator, False)
        flow.decoder.estimator_runner = None


def test_a_streamed_utterance_with_matmul_convs_equals_the_conv1d_one(flow, g, monkeypatch):
    flow.decoder.estimator_runner = None
    expected = _stream(flow, g)
    calls = []

    def counted(*args):
        calls.append(1)
        return grouped_conv1d_as_matmul(*args)

    monkeypatch.setattr(dit, "grouped_conv1d_as_matmul", counted)
    got = _matmul_stream(flow, g)
    chunks = len(HOPS) + 1
    assert len(calls) == 2 * chunks * flow.decoder.n_timesteps, len(calls)  # two convs a forward
    assert got.shape == expected.shape and got.shape[2] > 0
    assert (got - expected).abs().max().item() <= 1e-5


def test_the_static_steps_take_the_matmul_convs_too(flow, g):
    flow.decoder.estimator_runner = None
    expected = _stream(flow, g)
    runner = CapturedEstimator(StreamingEstimator(flow.decoder.estimator), buckets=Buckets(max_rows=4))
    got = _matmul_stream(flow, g, runner)
    assert (got - expected).abs().max().item() <= 1e-5
    assert runner.stats.replays > 0
