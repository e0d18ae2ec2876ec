"""Voice registration runs on the engine thread as an engine command (tiny CosyVoice2 model)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import soundfile
import torch
from cv2_engine_helpers import build_speaking_model_dir, load_speaking_model, make_backend

from voicertc.backends.cosyvoice.serve.backend import register_voice_command
from voicertc.config import FakeConfig
from voicertc.engine.fake import FakeEngine
from voicertc.engine.worker import EngineWorker
from voicertc.errors import InputError


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory):
    torch.set_num_threads(2)
    out = tmp_path_factory.mktemp("cv2_voice_cmd")
    return load_speaking_model(build_speaking_model_dir(tiny_model_dir, golden_dir, out))


def _wav(path, seconds: float = 2.0, rate_hz: int = 16000):
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    soundfile.write(str(path), (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), rate_hz)
    return path


def test_register_voice_command_runs_on_the_engine_thread(model, golden_dir, tmp_path, monkeypatch):
    backend = make_backend(model, golden_dir, voices_dir=tmp_path / "voices")
    threads: list[str] = []
    original = backend.book.register_wav

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(backend.book, "register_wav", recording)
    engine = EngineWorker(backend, name="cv2")
    engine.start()
    try:
        voice_id = engine.submit_command(register_voice_command(_wav(tmp_path / "p.wav"), "Hello.", "mine"))
        assert voice_id.result(120) == "mine" and threads == ["voicertc-cv2"]
        assert "mine" in engine.voices()
        again = engine.submit_command(register_voice_command(tmp_path / "p.wav", "Hello.", "mine"))
        with pytest.raises(InputError, match="already exists"):
            again.result(120)
    finally:
        engine.stop()


def test_another_backend_refuses_the_command(tmp_path):
    engine = FakeEngine(FakeConfig(ttfa_ms=0))
    engine.start()
    try:
        with pytest.raises(InputError, match="cannot register voices"):
            engine.submit_command(register_voice_command(tmp_path / "x.wav", "Hi.")).result(10)
    finally:
        engine.stop()
