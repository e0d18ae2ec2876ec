"""Start-up checks of a CosyVoice2 directory's frontend files: each is opened and smoke-run once.

Without them a missing tokenizer or a broken ONNX file is found at the first speak or the first voice
registration, long after `/healthz` said ok. Each check raises ModelDirError naming the file and what
is wrong with it. Runs wherever the model is loaded (the engine thread).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from voicertc.backends.cosyvoice.llm.qwen2lm import SPEECH_TOKEN_SIZE
from voicertc.backends.cosyvoice.voice.text import ENDOFPROMPT
from voicertc.errors import ModelDirError

if TYPE_CHECKING:
    from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model

logger = logging.getLogger(__name__)

SMOKE_TEXT = f"Hello, world 123. 你好。{ENDOFPROMPT}"
SMOKE_SECONDS = 1.0
TOKENIZER_RATE_HZ = 16000


def smoke_wav(seconds: float = SMOKE_SECONDS, rate_hz: int = TOKENIZER_RATE_HZ) -> np.ndarray:
    """[1, N] float32: a voiced-sounding tone with a little noise (deterministic)."""
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    rng = np.random.default_rng(0)
    wav = 0.3 * np.sin(2 * np.pi * 150 * t) * (1 + 0.5 * np.sin(2 * np.pi * 4 * t))
    return (wav + 0.01 * rng.standard_normal(len(t))).astype(np.float32)[None]


def check_text_tokenizer(model: CosyVoice2Model) -> None:
    where = model.text_frontend.blanken_dir
    try:
        ids = model.text_frontend.encode(SMOKE_TEXT)
    except ModelDirError:
        raise
    except Exception as exc:  # tokenizers raise several types
        raise ModelDirError(f"{where}: the text tokenizer fails on a smoke text ({exc})") from exc
    endofprompt = model.text_frontend.tokenizer.endofprompt_id
    if endofprompt not in ids:
        raise ModelDirError(f"{where}: {ENDOFPROMPT} is not encoded as one special token")
    vocab = model.llm.text_vocab_size
    if max(ids) >= vocab:
        raise ModelDirError(
            f"{where}: the tokenizer gives id {max(ids)}, beyond the LLM's {vocab} text embeddings "
            "(tokenizer and llm.pt do not belong together)"
        )


def check_speech_tokenizer(model: CosyVoice2Model) -> None:
    path = model.model_dir / "speech_tokenizer_v2.onnx"
    try:
        tokens = model.speech_tokenizer(smoke_wav())
    except ModelDirError:
        raise
    except Exception as exc:  # onnxruntime raises its own types
        raise ModelDirError(f"{path}: fails on 1 s of audio ({type(exc).__name__}: {exc})") from exc
    if tokens.numel() == 0:
        raise ModelDirError(f"{path}: gives no speech tokens for 1 s of audio")
    if int(tokens.min()) < 0 or int(tokens.max()) >= SPEECH_TOKEN_SIZE:
        raise ModelDirError(f"{path}: gives speech token ids outside [0, {SPEECH_TOKEN_SIZE})")


def check_campplus(model: CosyVoice2Model) -> None:
    path = model.model_dir / "campplus.onnx"
    try:
        embedding = model.campplus(smoke_wav())
    except ModelDirError:
        raise
    except Exception as exc:  # onnxruntime raises its own types
        raise ModelDirError(f"{path}: fails on 1 s of audio ({type(exc).__name__}: {exc})") from exc
    want = model.flow.cfg.spk_embed_dim
    if embedding.shape != (1, want):
        raise ModelDirError(
            f"{path}: speaker embedding of shape {tuple(embedding.shape)}, expected (1, {want})"
        )
    if not bool(torch.isfinite(embedding).all()):
        raise ModelDirError(f"{path}: speaker embedding is not finite")


def check_frontend(model: CosyVoice2Model) -> None:
    """Open and smoke-run the text tokenizer, the speech tokenizer and CAM++ (ModelDirError on the first
    that fails, naming its file)."""
    for check in (check_text_tokenizer, check_speech_tokenizer, check_campplus):
        check(model)
    logger.info("%s: text tokenizer, speech tokenizer and CAM++ checked", model.model_dir)
