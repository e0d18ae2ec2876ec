"""The two ONNX models of the CosyVoice2 frontend: speech tokenizer (25 Hz ids) and CAM++ (speaker vector).

Sessions are created on first use, on CPU with one intra-op thread as the reference does, so building an
engine does not pay for models a voice never needs; a missing file fails at construction, naming it.
Inputs are fed by position (the reference reads the names from the session), so exported models with
other input names still work.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from voicertc.backends.cosyvoice.voice.features import kaldi_fbank, whisper_log_mel
from voicertc.errors import InputError, ModelDirError

if TYPE_CHECKING:
    import onnxruntime

logger = logging.getLogger(__name__)

MAX_TOKENIZER_PROMPT_S = 30.0


class _LazySession:
    """One onnxruntime session, created on first use; safe to share between threads."""

    def __init__(self, path: str | Path, threads: int = 1) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelDirError(f"{self.path}: ONNX model not found")
        self._threads = threads
        self._session: onnxruntime.InferenceSession | None = None
        self._lock = threading.Lock()

    def session(self) -> onnxruntime.InferenceSession:
        with self._lock:
            if self._session is None:
                import onnxruntime as ort

                options = ort.SessionOptions()
                options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
                options.intra_op_num_threads = self._threads
                try:
                    self._session = ort.InferenceSession(
                        str(self.path), sess_options=options, providers=["CPUExecutionProvider"]
                    )
                except Exception as exc:  # onnxruntime raises its own exception types
                    raise ModelDirError(f"{self.path}: cannot load ONNX model ({exc})") from exc
                logger.info("loaded %s", self.path)
            return self._session

    def run(self, *inputs: np.ndarray) -> np.ndarray:
        session = self.session()
        names = [node.name for node in session.get_inputs()]
        if len(names) != len(inputs):
            raise ModelDirError(f"{self.path}: expected {len(inputs)} inputs, the model has {len(names)}")
        return session.run(None, dict(zip(names, inputs, strict=True)))[0]


class SpeechTokenizer:
    """speech_tokenizer_v2.onnx: 16 kHz prompt audio -> speech token ids at 25 Hz."""

    def __init__(self, path: str | Path) -> None:
        self._model = _LazySession(path)

    def tokens_from_features(self, feats: Tensor) -> Tensor:
        # feats: [1, 128, T] whisper log-mel -> tokens: [1, ~T / 4] int32
        feats_np = feats.detach().cpu().numpy().astype(np.float32)
        length = np.array([feats_np.shape[2]], dtype=np.int32)
        tokens = self._model.run(feats_np, length)
        return torch.from_numpy(np.asarray(tokens).reshape(1, -1).astype(np.int32))

    def __call__(self, wav_16k: Tensor | np.ndarray) -> Tensor:
        # wav_16k: [1, N] -> tokens: [1, N / 640] int32
        samples = np.shape(wav_16k)[-1]
        if samples > MAX_TOKENIZER_PROMPT_S * 16000:
            raise InputError(f"prompt audio longer than {MAX_TOKENIZER_PROMPT_S:.0f} s cannot be tokenized")
        return self.tokens_from_features(whisper_log_mel(wav_16k))


class CampPlus:
    """campplus.onnx: 16 kHz prompt audio -> 192-d speaker embedding (flow conditioning)."""

    def __init__(self, path: str | Path) -> None:
        self._model = _LazySession(path)

    def embedding_from_features(self, fbank: Tensor) -> Tensor:
        # fbank: [T, 80] mean-normalised -> embedding: [1, D] float32
        feats = fbank.detach().cpu().numpy().astype(np.float32)[None]
        embedding = self._model.run(feats)
        return torch.from_numpy(np.asarray(embedding, dtype=np.float32).reshape(1, -1))

    def __call__(self, wav_16k: Tensor | np.ndarray) -> Tensor:
        # wav_16k: [1, N] -> embedding: [1, 192]
        return self.embedding_from_features(kaldi_fbank(wav_16k))
