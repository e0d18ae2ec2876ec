"""`[engine] estimator`, `dtype` on CPU: `create_backend` swaps the accelerated pieces in and warms them up
(one LLM step, one flow chunk and one vocoder run through the chosen path) before serving."""

from __future__ import annotations

import pytest
import torch
from cv2_engine_helpers import build_speaking_model_dir

from voicertc.backends.cosyvoice.accel.onnx_export import ESTIMATOR_FILE
from voicertc.backends.cosyvoice.flow.graph import OnnxRuntimeEstimator
from voicertc.backends.cosyvoice.serve.backend import create_backend
from voicertc.config import Config
from voicertc.errors import ConfigError


@pytest.fixture(scope="module")
def speaking_dir(tiny_model_dir, golden_dir, tmp_path_factory):
    return build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("cv2_accel"))


def _config(model_dir, **engine) -> Config:
    return Config().replace("engine", backend="cosyvoice2", model_dir=str(model_dir), device="cpu", **engine)


def test_onnx_estimator_is_exported_on_first_use_and_warmed_up(speaking_dir, tmp_path):
    accel = tmp_path / "accel"
    backend = create_backend(_config(speaking_dir, estimator="onnx", accel_dir=str(accel), voices_dir=""))
    assert isinstance(backend.model.flow.decoder.estimator_runner, OnnxRuntimeEstimator)
    assert (accel / ESTIMATOR_FILE).is_file()


def test_bfloat16_on_cpu_loads_and_warms_up(speaking_dir):
    backend = create_backend(_config(speaking_dir, dtype="bfloat16", voices_dir=""))
    assert backend.model.dtype == torch.bfloat16
    assert backend.model.flow.decoder.estimator_runner is None


def test_gpu_only_paths_are_refused_on_cpu(speaking_dir):
    with pytest.raises(ConfigError, match="engine.estimator"):
        create_backend(_config(speaking_dir, estimator="tensorrt", voices_dir=""))
    with pytest.raises(ConfigError, match="engine.llm"):
        create_backend(_config(speaking_dir, llm="vllm", voices_dir=""))
    with pytest.raises(ConfigError, match="engine.cuda_graphs"):
        create_backend(_config(speaking_dir, cuda_graphs=True, voices_dir=""))


def test_llm_thread_builds_a_started_streamer_and_stops_it(speaking_dir):
    from voicertc.backends.cosyvoice.llm.streamer import ThreadedSpeechLlm

    backend = create_backend(_config(speaking_dir, llm="thread", voices_dir=""))
    streamer = backend.streamer
    assert isinstance(streamer, ThreadedSpeechLlm)
    assert streamer._thread is not None and streamer._thread.is_alive()
    backend.close()
    assert not streamer._thread.is_alive()
