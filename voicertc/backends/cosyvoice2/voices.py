"""CosyVoice2 voices: what a speaker needs, computed once and reused by every utterance.

A `Voice` holds the LLM prompt (transcript tokens + prompt speech tokens and the KV-cache prefix of
[sos, transcript]) and the flow prompt (tokens, 50 Hz mel, CAM++ embedding and the flow state after the
prompt, cloned per utterance). Voices come from `spk2info.pt` (sft: embedding only, empty prompt), from
a (wav, transcript) pair through the speech tokenizer, CAM++ and the prompt mel (zero-shot), or from
features directly. `VoiceStore` persists zero-shot voices in the voices directory (one safetensors +
one json per voice; the json is written last, so a crash never leaves a half-registered voice) and
`VoiceBook` is the engine's thread-safe id -> Voice map.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from voicertc.backends.cosyvoice2.features import (
    PROMPT_SAMPLE_RATE_HZ,
    TOKENIZER_SAMPLE_RATE_HZ,
    prompt_mel,
    resample_wav,
)
from voicertc.backends.cosyvoice2.flow import FlowStreamState
from voicertc.backends.cosyvoice2.llm import PrefixCache
from voicertc.backends.cosyvoice2.text import text_normalize
from voicertc.errors import InputError, UnknownVoiceError

if TYPE_CHECKING:
    from voicertc.backends.cosyvoice2.loader import CosyVoice2Model

logger = logging.getLogger(__name__)

MIN_PROMPT_S, MAX_PROMPT_S = 1.0, 30.0
VOICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
FORMAT_VERSION = 1
VoiceKind = Literal["sft", "zero_shot"]


@dataclass
class Voice:
    """A speaker, ready to speak. Read-only after construction; shared by utterances (never mutated).

    `prompt_text_tokens` / `llm_prompt_tokens` are empty for sft voices and for voices registered from
    features without a transcript (the LLM then speaks without a prompt, like cross-lingual mode).
    """

    voice_id: str
    kind: VoiceKind
    prompt_text: str
    prompt_text_tokens: tuple[int, ...]
    llm_prompt_tokens: tuple[int, ...]  # speech tokens of the prompt, as the LLM sees them
    flow_prompt_tokens: Tensor  # [1, p] int
    prompt_feat: Tensor  # [1, 2p, 80] prompt mel
    embedding: Tensor  # [1, 192] CAM++ speaker vector
    flow_state: FlowStreamState  # after the prompt; clone() per utterance
    prefix: PrefixCache  # LLM KV cache of [sos, prompt text]

    @property
    def prompt_tokens(self) -> int:
        return int(self.flow_prompt_tokens.shape[1])


def check_voice_id(voice_id: str) -> str:
    if not VOICE_ID.match(voice_id):
        raise InputError(f"bad voice id {voice_id!r}: use 1-64 letters, digits, '_', '-', '.'")
    return voice_id


def voice_from_features(
    model: CosyVoice2Model,
    prompt_tokens: Tensor | Sequence[int],
    prompt_feat: Tensor,
    embedding: Tensor,
    prompt_text_tokens: Sequence[int] | Tensor | None = None,
    voice_id: str | None = None,
    *,
    prompt_text: str = "",
    kind: VoiceKind = "zero_shot",
) -> Voice:
    """A voice from prompt speech tokens [1, p], prompt mel [1, 2p, 80] and embedding [1, 192].

    Without `prompt_text_tokens` the LLM gets no prompt at all (its prompt speech would have no
    transcript to align with); the flow still uses the prompt."""
    tokens = torch.as_tensor(prompt_tokens).reshape(1, -1).to(torch.long)
    feat = torch.as_tensor(prompt_feat, dtype=torch.float32)
    embedding = torch.as_tensor(embedding, dtype=torch.float32).reshape(1, -1)
    try:
        flow_state = model.flow.init_stream(
            tokens.to(model.device), feat.to(model.device), embedding.to(model.device)
        )
    except ValueError as exc:
        raise InputError(f"bad voice prompt: {exc}") from exc
    text_ids = () if prompt_text_tokens is None else tuple(model.llm.check_text_ids(prompt_text_tokens))
    llm_prompt = () if prompt_text_tokens is None else tuple(model.llm.check_speech_ids(tokens[0].tolist()))
    return Voice(
        voice_id=check_voice_id(voice_id or f"voice-{uuid.uuid4().hex[:8]}"),
        kind=kind,
        prompt_text=prompt_text,
        prompt_text_tokens=text_ids,
        llm_prompt_tokens=llm_prompt,
        flow_prompt_tokens=tokens.cpu(),
        prompt_feat=feat.cpu(),
        embedding=embedding.cpu(),
        flow_state=flow_state,
        prefix=model.llm.prefix_cache(list(text_ids)),
    )


def sft_voice(model: CosyVoice2Model, voice_id: str, info: dict[str, Tensor]) -> Voice:
    """A `spk2info.pt` speaker: the embedding only, no prompt (official sft mode)."""
    if "embedding" not in info:
        raise InputError(f"spk2info speaker {voice_id!r} has no 'embedding'")
    bins = model.flow.cfg.mel_bins
    return voice_from_features(
        model, torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, bins), info["embedding"], None,
        voice_id, kind="sft",
    )  # fmt: skip


def read_prompt_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Mono float32 samples and rate of a prompt file; InputError unless it is 1-30 s of audio."""
    import soundfile

    try:
        data, rate_hz = soundfile.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises LibsndfileError, RuntimeError, OSError...
        raise InputError(f"{path}: not a readable audio file ({exc})") from exc
    wav = data.mean(axis=1).astype(np.float32)
    seconds = len(wav) / rate_hz if rate_hz else 0.0
    if seconds < MIN_PROMPT_S:
        raise InputError(f"{path}: prompt audio is {seconds:.2f} s, shorter than {MIN_PROMPT_S:.0f} s")
    if seconds > MAX_PROMPT_S:
        raise InputError(f"{path}: prompt audio is {seconds:.1f} s, longer than {MAX_PROMPT_S:.0f} s")
    return wav, int(rate_hz)


def voice_from_wav(
    model: CosyVoice2Model, path: str | Path, transcript: str, voice_id: str | None = None
) -> Voice:
    """Zero-shot voice from a prompt recording and its transcript (cosyvoice.md §2.4-2.5).

    16 kHz for the speech tokenizer and CAM++, 24 kHz for the prompt mel; then the reference's 2:1
    trim: both token lists and the mel are cut to min(mel frames // 2, tokens) tokens."""
    if not transcript or not transcript.strip():
        raise InputError("the prompt transcript is empty")
    if voice_id is not None:
        check_voice_id(voice_id)
    wav, rate_hz = read_prompt_wav(path)
    wav_16k = resample_wav(wav, rate_hz, TOKENIZER_SAMPLE_RATE_HZ)[None]
    wav_24k = resample_wav(wav, rate_hz, PROMPT_SAMPLE_RATE_HZ)[None]
    feat = prompt_mel(wav_24k, model.prompt_mel_fmax_hz)  # [1, T, 80]
    tokens = model.speech_tokenizer(wav_16k)  # [1, n]
    embedding = model.campplus(wav_16k)  # [1, 192]
    token_len = min(feat.shape[1] // 2, tokens.shape[1])
    if token_len == 0:
        raise InputError(f"{path}: the speech tokenizer found no speech tokens")
    feat, tokens = feat[:, : 2 * token_len], tokens[:, :token_len]
    text = text_normalize(transcript.strip(), model.text_frontend.encode, split=False)[0]
    text_ids = model.text_frontend.encode(text)
    if not text_ids:
        raise InputError("the prompt transcript has no text tokens")
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(path).stem)[:64] or "voice"
    return voice_from_features(
        model, tokens, feat, embedding, text_ids, voice_id or stem, prompt_text=transcript.strip()
    )


class VoiceStore:
    """Zero-shot voices on disk: `<id>.safetensors` (tensors) + `<id>.json` (metadata, written last)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def ids(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        return sorted(
            p.stem for p in self.directory.glob("*.json") if p.with_suffix(".safetensors").is_file()
        )

    def save(self, voice: Voice) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        base = self.directory / voice.voice_id
        tensors = {
            "flow_prompt_tokens": voice.flow_prompt_tokens.to(torch.int32).contiguous(),
            "prompt_feat": voice.prompt_feat.contiguous(),
            "embedding": voice.embedding.contiguous(),
            "prompt_text_tokens": torch.tensor([voice.prompt_text_tokens], dtype=torch.int32).reshape(1, -1),
            "llm_prompt_tokens": torch.tensor([voice.llm_prompt_tokens], dtype=torch.int32).reshape(1, -1),
        }
        meta = {"format": FORMAT_VERSION, "voice_id": voice.voice_id, "prompt_text": voice.prompt_text}
        _atomic(base.with_suffix(".safetensors"), lambda p: save_file(tensors, str(p)))
        _atomic(base.with_suffix(".json"), lambda p: p.write_text(json.dumps(meta, ensure_ascii=False)))

    def load(self, model: CosyVoice2Model, voice_id: str) -> Voice:
        base = self.directory / check_voice_id(voice_id)
        meta = json.loads(base.with_suffix(".json").read_text(encoding="utf-8"))
        t = load_file(str(base.with_suffix(".safetensors")))
        text_ids = t["prompt_text_tokens"][0].tolist()
        voice = voice_from_features(
            model, t["flow_prompt_tokens"], t["prompt_feat"], t["embedding"],
            text_ids if t["llm_prompt_tokens"].numel() else None, voice_id,
            prompt_text=str(meta.get("prompt_text", "")),
        )  # fmt: skip
        return voice

    def delete(self, voice_id: str) -> None:
        base = self.directory / check_voice_id(voice_id)
        base.with_suffix(".json").unlink(missing_ok=True)  # uncommit first
        base.with_suffix(".safetensors").unlink(missing_ok=True)


def _atomic(path: Path, write) -> None:  # noqa: ANN001 - a one-argument writer
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class VoiceBook:
    """The engine's voices: sft voices of the model plus the store's, by id. Thread-safe.

    Registration runs on the caller's thread (prompt features are CPU/ONNX work); the voice becomes
    visible only after it is complete and persisted."""

    def __init__(self, model: CosyVoice2Model, store: VoiceStore | None) -> None:
        self.model = model
        self.store = store
        self._lock = threading.Lock()
        self._voices: dict[str, Voice] = {}
        for voice_id, info in model.sft_voices.items():
            self._voices[voice_id] = sft_voice(model, voice_id, info)
        for voice_id in store.ids() if store is not None else []:
            try:
                self._voices[voice_id] = store.load(model, voice_id)
            except Exception:  # a broken file must not stop the engine: log it, skip the voice
                logger.exception("voice %s in %s cannot be loaded; skipped", voice_id, store.directory)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._voices)

    def get(self, voice_id: str) -> Voice:
        with self._lock:
            voice = self._voices.get(voice_id)
        if voice is None:
            raise UnknownVoiceError(
                f"unknown voice {voice_id!r}; available: {', '.join(self.ids()) or 'none'}"
            )
        return voice

    def add(self, voice: Voice, *, persist: bool = True) -> Voice:
        with self._lock:
            if voice.voice_id in self._voices:
                raise InputError(f"voice {voice.voice_id!r} already exists")
            if persist and self.store is not None:
                self.store.save(voice)
            self._voices[voice.voice_id] = voice
        logger.info("voice %s registered (%d prompt tokens)", voice.voice_id, voice.prompt_tokens)
        return voice

    def register_wav(self, path: str | Path, transcript: str, voice_id: str | None = None) -> Voice:
        if voice_id is not None and voice_id in self.ids():
            raise InputError(f"voice {voice_id!r} already exists")
        return self.add(voice_from_wav(self.model, path, transcript, voice_id))

    def delete(self, voice_id: str) -> None:
        with self._lock:
            voice = self._voices.get(voice_id)
            if voice is None:
                raise UnknownVoiceError(f"unknown voice {voice_id!r}")
            if voice.kind == "sft":
                raise InputError(f"voice {voice_id!r} comes from spk2info.pt and cannot be deleted")
            if self.store is not None:
                self.store.delete(voice_id)
            del self._voices[voice_id]
