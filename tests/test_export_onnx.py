"""`voicertc export onnx`: ONNX Runtime (CPU) reproduces whole streamed utterances of the eager flow
estimator (chunks concatenated, also several utterances at different positions in one batch) and of
HiFT (mel cache, excitation cache, overlap-add), within 1e-4."""

from __future__ import annotations

import pytest
import torch
from flow_stream_helpers import stream_golden, two_utterances

from voicertc.backends.cosyvoice.accel.hift_ort import OnnxHift
from voicertc.backends.cosyvoice.accel.onnx_export import ESTIMATOR_FILE, load_hift
from voicertc.backends.cosyvoice.flow.graph import GraphLayout, OnnxRuntimeEstimator
from voicertc.backends.cosyvoice.hift.stream import hift_stream_step, init_hift_stream_state

TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def onnx_dir(tiny_model_dir, tmp_path_factory):
    from signaling.cli import main

    out = tmp_path_factory.mktemp("onnx")
    assert main(["export", "onnx", str(tiny_model_dir), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def runner(flow, onnx_dir):
    return OnnxRuntimeEstimator(onnx_dir / ESTIMATOR_FILE, GraphLayout.of(flow.decoder.estimator), threads=2)


def test_onnx_estimator_reproduces_a_streamed_utterance(flow, runner, tts_golden):
    hops = [25, 50, 100, 100]
    flow.decoder.estimator_runner = None
    eager = stream_golden(flow, tts_golden, hops)
    flow.decoder.estimator_runner = runner
    try:
        got = stream_golden(flow, tts_golden, hops)
    finally:
        flow.decoder.estimator_runner = None
    assert got.shape == eager.shape and eager.shape[2] > 300
    assert (got - eager).abs().max().item() <= TOL


def test_onnx_estimator_batches_utterances_at_different_positions(flow, runner, tts_golden):
    flow.decoder.estimator_runner = None
    eager = two_utterances(flow, tts_golden)
    flow.decoder.estimator_runner = runner
    try:
        got = two_utterances(flow, tts_golden)
    finally:
        flow.decoder.estimator_runner = None
    for e, g in zip(eager, got, strict=True):
        assert (g - e).abs().max().item() <= TOL


def test_onnx_hift_reproduces_a_streamed_utterance(tiny_model_dir, onnx_dir):
    hift = load_hift(tiny_model_dir)
    onnx_hift = OnnxHift(onnx_dir, hift, threads=2)
    mel = torch.randn(1, 80, 250, generator=torch.Generator().manual_seed(5)) * 2 - 6  # log-mel-like

    def vocode(vocoder) -> torch.Tensor:
        generator, state, pcm = torch.Generator().manual_seed(11), init_hift_stream_state(), []
        bounds = [0, 68, 168, mel.shape[2]]
        for i in range(3):
            chunk = mel[:, :, bounds[i] : bounds[i + 1]]
            pcm.append(hift_stream_step(vocoder, chunk, state, i == 2, generator=generator))
        return torch.cat(pcm)

    eager, got = vocode(hift), vocode(onnx_hift)
    assert got.shape == eager.shape and eager.abs().max() > 1e-3
    assert (got - eager).abs().max().item() <= TOL
