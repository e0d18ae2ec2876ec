"""CosyVoice2 voices: what a speaker needs, computed once and reused by every utterance.

A `Voice` holds the LLM prompt (transcript tokens + prompt speech tokens and the KV-cache prefix of
[sos, transcript]) and the flow prompt (tokens, 50 Hz mel, CAM++ embedding and the flow state after the
prompt, cloned per utterance). Voices come from `spk2info.pt` (every entry layout the reference writes:
sft entries with an `embedding` only, `add_zero_shot_spk` entries with prompt text / tokens / mel and
`flow_embedding`), from a clip and its transcript through the speech tokenizer, CAM++ and the prompt mel
(zero-shot; without a transcript: cross-lingual, the LLM gets no prompt), or from features directly.
`VoiceStore` persists registered voices in the voices directory (one safetensors + one json per voice;
the json is written last, so a crash never leaves a half-registered voice) and `VoiceBook` is the
engine's thread-safe id -> Voice map; a spk2info entry or stored voice that cannot be used is skipped
with one log line naming it, never stopping the engine.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from voicertc.audio.decode import AudioError, Clip, ClipLimits, load_clip
from voicertc.backends.cosyvoice.flow.flow import FlowStreamState
from voicertc.backends.cosyvoice.llm.qwen2lm import PrefixCache
from voicertc.backends.cosyvoice.voice.features import (
    PROMPT_SAMPLE_RATE_HZ,
    TOKENIZER_SAMPLE_RATE_HZ,
    prompt_mel,
    resample_wav,
)
from voicertc.backends.cosyvoice.voice.text import text_normalize
from voicertc.backends.cosyvoice.voice.text_prep import TextPrep
from voicertc.backends.cosyvoice.voice.voice_caches import VoiceCaches
from voicertc.engine.parts import Parts, run_to_end
from voicertc.engine.voice_book import MAX_PROMPT_S, MIN_PROMPT_S, check_prompt
from voicertc.errors import InputError, UnknownVoiceError, VoiceExistsError, VoiceReadOnlyError
from voicertc.voice_ids import check_voice_id, free_voice_id, voice_id_of, voice_path

if TYPE_CHECKING:
    from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
VoiceKind = Literal["sft", "zero_shot", "cross_lingual"]
VoiceSource = Literal["spk2info", "store", "memory"]
TOKEN_RATE_HZ = 25


@dataclass
class Voice:
    """A speaker, ready to speak. Read-only after construction; shared by utterances (never mutated).

    `prompt_text_tokens` / `llm_prompt_tokens` are empty for sft voices and for cross-lingual voices
    (registered without a transcript: the LLM then speaks without a prompt, cosyvoice.md §2.5).
    """

    voice_id: str
    kind: VoiceKind
    prompt_text: str
    prompt_text_tokens: tuple[int, ...]
    llm_prompt_tokens: tuple[int, ...]  # speech tokens of the prompt, as the LLM sees them
    flow_prompt_tokens: Tensor  # [1, p] int
    prompt_feat: Tensor  # [1, 2p, 80] prompt mel
    embedding: Tensor  # [1, 192] CAM++ speaker vector
    caches: VoiceCaches  # the flow state after the prompt and the LLM prefix, built on first use
    name: str = ""
    source: VoiceSource = "memory"
    created_s: float = 0.0  # unix time of registration (0 = unknown)

    @property
    def flow_state(self) -> FlowStreamState:
        """The flow state after the prompt (built on first use; clone() per utterance)."""
        return self.caches.flow_state

    @property
    def prefix(self) -> PrefixCache:
        """The LLM KV cache of [sos, prompt text] (built on first use)."""
        return self.caches.prefix

    @property
    def prompt_tokens(self) -> int:
        return int(self.flow_prompt_tokens.shape[1])

    def describe(self) -> dict[str, object]:
        """The voice as the HTTP API lists it."""
        return {
            "id": self.voice_id,
            "name": self.name or self.voice_id,
            "kind": self.kind,
            "transcript": self.prompt_text,
            "prompt_s": round(self.prompt_tokens / TOKEN_RATE_HZ, 2),
            "source": self.source,
            "deletable": self.source != "spk2info",
            "created_at": int(self.created_s) if self.created_s else None,
        }


def voice_from_features(
    model: CosyVoice2Model,
    prompt_tokens: Tensor | Sequence[int],
    prompt_feat: Tensor,
    embedding: Tensor,
    prompt_text_tokens: Sequence[int] | Tensor | None = None,
    voice_id: str | None = None,
    *,
    prompt_text: str = "",
    kind: VoiceKind | None = None,
    llm_prompt_tokens: Tensor | Sequence[int] | None = None,
    name: str = "",
    source: VoiceSource = "memory",
    created_s: float = 0.0,
    lazy: bool = False,
) -> Voice:
    """A voice from prompt speech tokens [1, p], prompt mel [1, 2p, 80] and embedding [1, 192].

    Without `prompt_text_tokens` the LLM gets no prompt at all (its prompt speech would have no
    transcript to align with: cross-lingual); the flow still uses the prompt. `llm_prompt_tokens`
    defaults to the flow prompt tokens (the reference trims both alike). `lazy`: the prompt caches
    (flow state, LLM prefix) are built when an utterance first needs them, not now."""
    tokens = torch.as_tensor(prompt_tokens).reshape(1, -1).to(torch.long)
    feat = torch.as_tensor(prompt_feat, dtype=torch.float32)
    embedding = torch.as_tensor(embedding, dtype=torch.float32).reshape(1, -1)
    try:
        text_ids = () if prompt_text_tokens is None else tuple(model.llm.check_text_ids(prompt_text_tokens))
        llm_source = (
            tokens if llm_prompt_tokens is None else torch.as_tensor(llm_prompt_tokens).reshape(1, -1)
        )
        llm_prompt = tuple(model.llm.check_speech_ids(llm_source[0].tolist())) if text_ids else ()
    except ValueError as exc:
        raise InputError(f"bad voice prompt: {exc}") from exc
    if kind is None:
        kind = "zero_shot" if text_ids else ("sft" if tokens.shape[1] == 0 else "cross_lingual")
    caches = VoiceCaches(
        lambda: _prompt_flow_parts(model, tokens, feat, embedding),
        lambda: model.llm.prefix_cache_parts(list(text_ids)),
    )
    if not lazy:
        caches.build()
    return Voice(
        voice_id=check_voice_id(voice_id or f"voice-{uuid.uuid4().hex[:8]}"),
        kind=kind,
        prompt_text=prompt_text,
        prompt_text_tokens=text_ids,
        llm_prompt_tokens=llm_prompt,
        flow_prompt_tokens=tokens.cpu(),
        prompt_feat=feat.cpu(),
        embedding=embedding.cpu(),
        caches=caches,
        name=name,
        source=source,
        created_s=created_s,
    )


def _prompt_flow_parts(
    model: CosyVoice2Model, tokens: Tensor, feat: Tensor, embedding: Tensor
) -> Parts[FlowStreamState]:
    """The flow's prompt state in parts; the prompt is checked now (InputError names the problem)."""
    try:
        return model.flow.init_stream_parts(
            tokens.to(model.device), feat.to(model.device), embedding.to(model.device)
        )
    except ValueError as exc:
        raise InputError(f"bad voice prompt: {exc}") from exc


def sft_voice(model: CosyVoice2Model, voice_id: str, info: Mapping[str, object]) -> Voice:
    """A `spk2info.pt` speaker: the embedding only, no prompt (official sft mode)."""
    if "embedding" not in info:
        raise InputError(f"spk2info speaker {voice_id!r} has no 'embedding'")
    bins = model.flow.cfg.mel_bins
    return voice_from_features(
        model, torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, bins), _tensor(info, "embedding"), None,
        voice_id, kind="sft", source="spk2info",
    )  # fmt: skip


def _tensor(info: Mapping[str, object], key: str) -> Tensor:
    value = info[key]
    if not isinstance(value, Tensor):
        raise InputError(f"{key!r} is a {type(value).__name__}, not a tensor")
    return value.detach().cpu()


def _prompt_text_ids(model: CosyVoice2Model, value: object) -> list[int]:
    """spk2info `prompt_text`: token ids [1, n] as the reference stores them (or a string, encoded)."""
    if isinstance(value, str):
        return model.text_frontend.encode(value) if value.strip() else []
    if isinstance(value, Tensor):
        return [int(t) for t in value.reshape(-1).tolist()]
    raise InputError(f"'prompt_text' is a {type(value).__name__}, not token ids")


def voice_from_spk2info(model: CosyVoice2Model, voice_id: str, info: object) -> Voice:
    """One `spk2info.pt` entry, whatever layout the reference wrote (cosyvoice.md §1.1, §2.5):

    * sft (`frontend_sft`): {'embedding': [1, 192]} -> prompt-free voice;
    * `add_zero_shot_spk`: 'prompt_text' [1, n] ids, 'llm_prompt_speech_token' / 'flow_prompt_speech_token'
      [1, p], 'prompt_speech_feat' [1, 2p, 80], 'llm_embedding' / 'flow_embedding' [1, 192], plus `*_len`
      keys (ignored), no 'embedding' -> zero-shot voice (cross-lingual when the prompt text is empty).

    InputError names what is missing or malformed."""
    if not isinstance(info, Mapping):
        raise InputError(f"the entry is a {type(info).__name__}, not a dict of tensors")
    has_prompt = "flow_prompt_speech_token" in info or "prompt_speech_feat" in info
    if not has_prompt:
        return sft_voice(model, voice_id, info)
    missing = [k for k in ("flow_prompt_speech_token", "prompt_speech_feat") if k not in info]
    embedding_key = next((k for k in ("flow_embedding", "embedding", "llm_embedding") if k in info), None)
    if embedding_key is None:
        missing.append("flow_embedding")
    if missing or embedding_key is None:
        raise InputError(f"a zero-shot entry without {', '.join(missing)}")
    tokens = _tensor(info, "flow_prompt_speech_token").reshape(1, -1).to(torch.long)
    feat = _tensor(info, "prompt_speech_feat").to(torch.float32)
    if feat.dim() == 2:
        feat = feat[None]
    if feat.dim() != 3 or feat.shape[2] != model.flow.cfg.mel_bins:
        raise InputError(f"'prompt_speech_feat' has shape {tuple(feat.shape)}, expected [1, 2p, 80]")
    token_len = min(feat.shape[1] // 2, tokens.shape[1])  # the reference's 2:1 trim (already done)
    if token_len == 0:
        raise InputError("the prompt has no speech tokens")
    tokens, feat = tokens[:, :token_len], feat[:, : 2 * token_len]
    text_ids = _prompt_text_ids(model, info.get("prompt_text", ""))
    llm_tokens = info.get("llm_prompt_speech_token", tokens)
    if not isinstance(llm_tokens, Tensor):
        raise InputError("'llm_prompt_speech_token' is not a tensor")
    return voice_from_features(
        model, tokens, feat, _tensor(info, embedding_key), text_ids or None, voice_id,
        llm_prompt_tokens=llm_tokens.reshape(1, -1), source="spk2info",
        prompt_text=model.text_frontend.tokenizer.decode(text_ids) if text_ids else "",
    )  # fmt: skip


def read_prompt_wav(path: str | Path, limits: ClipLimits | None = None) -> Clip:
    """A prompt file as a mono clip; InputError (AudioError) unless it is usable audio within `limits`."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from exc
    try:
        return load_clip(data, limits or ClipLimits(MIN_PROMPT_S, MAX_PROMPT_S, max_bytes=1 << 62))
    except AudioError as exc:
        raise AudioError(exc.code, f"{path}: {exc}", exc.status) from exc


@dataclass(frozen=True)
class VoiceFeatures:
    """What a clip gives a voice before any model state (computed off the engine thread): prompt speech
    tokens [1, p], prompt mel [1, 2p, 80], CAM++ embedding [1, 192] and the transcript's token ids
    (None: no transcript, or one still to be tokenised on the engine thread when `text_pending`)."""

    voice_id: str | None
    tokens: Tensor
    feat: Tensor
    embedding: Tensor
    transcript: str
    text_ids: tuple[int, ...] | None
    text_pending: bool = False
    name: str = ""


def voice_features(
    model: CosyVoice2Model,
    clip: Clip,
    transcript: str | None,
    voice_id: str | None = None,
    *,
    name: str = "",
    prep: TextPrep | None = None,
) -> VoiceFeatures:
    """A clip's prompt features (cosyvoice.md §2.4-2.5); any thread (no engine state is touched).

    16 kHz for the speech tokenizer and CAM++, 24 kHz for the prompt mel; then the reference's 2:1
    trim: both token lists and the mel are cut to min(mel frames // 2, tokens) tokens. The transcript
    is normalised and tokenised by `prep` (a process pool); without one it is left for `voice_install`
    on the engine thread (the tokenizer is not shared across threads)."""
    text = check_prompt(clip, transcript, voice_id)
    wav, rate_hz = clip.samples, clip.sample_rate_hz
    wav_16k = resample_wav(wav, rate_hz, TOKENIZER_SAMPLE_RATE_HZ)[None]
    wav_24k = resample_wav(wav, rate_hz, PROMPT_SAMPLE_RATE_HZ)[None]
    feat = prompt_mel(wav_24k, model.prompt_mel_fmax_hz)  # [1, T, 80]
    tokens = model.speech_tokenizer(wav_16k)  # [1, n]
    embedding = model.campplus(wav_16k)  # [1, 192]
    token_len = min(feat.shape[1] // 2, tokens.shape[1])
    if token_len == 0:
        raise InputError("the speech tokenizer found no speech tokens in the prompt")
    feat, tokens = feat[:, : 2 * token_len], tokens[:, :token_len]
    text_ids: tuple[int, ...] | None = None
    if text and prep is not None:
        prepared = prep.submit(text, split=False).result()
        text_ids = tuple(i for _, ids in prepared.pieces[:1] for i in ids)
        if not text_ids:
            raise InputError("the prompt transcript has no text tokens")
    return VoiceFeatures(
        voice_id, tokens, feat, embedding, text, text_ids, text_pending=bool(text) and prep is None, name=name
    )


def voice_install(
    model: CosyVoice2Model, features: VoiceFeatures, *, source: VoiceSource = "memory", lazy: bool = False
) -> Voice:
    """The voice of `features`: the flow's prompt state and the LLM prefix (engine thread; `lazy`: built
    later, `voice.caches.advance()` a part at a time)."""
    text_ids = features.text_ids
    if features.text_pending:
        text = text_normalize(features.transcript, model.text_frontend.encode, split=False)[0]
        text_ids = tuple(model.text_frontend.encode(text))
        if not text_ids:
            raise InputError("the prompt transcript has no text tokens")
    return voice_from_features(
        model, features.tokens, features.feat, features.embedding, text_ids, features.voice_id,
        prompt_text=features.transcript, name=features.name, source=source, created_s=time.time(),
        lazy=lazy,
    )  # fmt: skip


def voice_from_samples(
    model: CosyVoice2Model,
    clip: Clip,
    transcript: str | None,
    voice_id: str | None = None,
    *,
    name: str = "",
    source: VoiceSource = "memory",
) -> Voice:
    """Zero-shot voice from a prompt clip and its transcript (cosyvoice.md §2.4-2.5); without a
    transcript, a cross-lingual voice (the flow gets the prompt, the LLM none). All on this thread."""
    features = voice_features(model, clip, transcript, voice_id, name=name)
    return voice_install(model, features, source=source)


def voice_from_wav(
    model: CosyVoice2Model, path: str | Path, transcript: str | None, voice_id: str | None = None
) -> Voice:
    """`voice_from_samples` of a prompt file (1-30 s; an id from the file name unless given)."""
    clip = read_prompt_wav(path)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(path).stem)[:64].lstrip("_.-") or "voice"
    if transcript:
        transcript = model.text_frontend.prompt_transcript(transcript)
    return voice_from_samples(model, clip, transcript, voice_id or stem)


class VoiceStore:
    """Zero-shot voices on disk: `<id>.safetensors` (tensors) + `<id>.json` (metadata, written last)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def ids(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        ids = (voice_id_of(p, ".json") for p in self.directory.glob("*.json"))
        return sorted(v for v in ids if v and voice_path(self.directory, v, ".safetensors").is_file())

    def save(self, voice: Voice) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tensors = {
            "flow_prompt_tokens": voice.flow_prompt_tokens.to(torch.int32).contiguous(),
            "prompt_feat": voice.prompt_feat.contiguous(),
            "embedding": voice.embedding.contiguous(),
            "prompt_text_tokens": torch.tensor([voice.prompt_text_tokens], dtype=torch.int32).reshape(1, -1),
            "llm_prompt_tokens": torch.tensor([voice.llm_prompt_tokens], dtype=torch.int32).reshape(1, -1),
        }
        meta = {
            "format": FORMAT_VERSION, "voice_id": voice.voice_id, "prompt_text": voice.prompt_text,
            "name": voice.name, "kind": voice.kind, "created_s": voice.created_s,
        }  # fmt: skip
        meta_json = json.dumps(meta, ensure_ascii=False)
        tensors_path = voice_path(self.directory, voice.voice_id, ".safetensors")
        _atomic(tensors_path, lambda p: save_file(tensors, str(p)))
        _atomic(voice_path(self.directory, voice.voice_id, ".json"), lambda p: p.write_text(meta_json))

    def load(self, model: CosyVoice2Model, voice_id: str) -> Voice:
        meta = json.loads(voice_path(self.directory, voice_id, ".json").read_text(encoding="utf-8"))
        t = load_file(str(voice_path(self.directory, voice_id, ".safetensors")))
        text_ids = t["prompt_text_tokens"][0].tolist()
        voice = voice_from_features(
            model, t["flow_prompt_tokens"], t["prompt_feat"], t["embedding"],
            text_ids if t["llm_prompt_tokens"].numel() else None, voice_id,
            prompt_text=str(meta.get("prompt_text", "")), llm_prompt_tokens=t["llm_prompt_tokens"],
            name=str(meta.get("name", "")), source="store", created_s=float(meta.get("created_s", 0.0)),
            lazy=True,
        )  # fmt: skip
        return voice

    def delete(self, voice_id: str) -> None:
        voice_path(self.directory, voice_id, ".json").unlink(missing_ok=True)  # uncommit first
        voice_path(self.directory, voice_id, ".safetensors").unlink(missing_ok=True)


def _atomic(path: Path, write) -> None:  # noqa: ANN001 - a one-argument writer
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class VoiceBook:
    """The engine's voices: the model's spk2info.pt entries plus the store's, by id. Thread-safe.

    Registration (`register`) runs on the engine thread (an engine command: the speech tokenizer, CAM++
    and the flow prompt run on the engine's device); a voice becomes visible only once it is complete
    and persisted. Reads (`ids`, `get`, `describe`) are safe from any thread."""

    def __init__(self, model: CosyVoice2Model, store: VoiceStore | None) -> None:
        self.model = model
        self.store = store
        self._lock = threading.Lock()
        self._voices: dict[str, Voice] = {}
        for voice_id, info in model.spk2info.items():
            try:
                self._voices[voice_id] = voice_from_spk2info(model, voice_id, info)
            except Exception as exc:  # noqa: BLE001 - a bad entry disables its voice, never the engine
                logger.error("spk2info.pt voice %r disabled: %s", voice_id, exc)
        if store is not None:
            self._load_stored(store)

    def _load_stored(self, store: VoiceStore) -> None:
        for voice_id in store.ids():
            if voice_id in self._voices:
                logger.error("stored voice %s skipped: spk2info.pt has a voice with that id", voice_id)
                continue
            try:
                self._voices[voice_id] = store.load(self.model, voice_id)
            except Exception as exc:  # noqa: BLE001 - a broken file must not stop the engine
                logger.error("stored voice %s in %s disabled: %s", voice_id, store.directory, exc)

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

    def cache_bytes(self) -> int:
        """Bytes the voices' prompt caches hold now (voices never used hold none)."""
        with self._lock:
            voices = list(self._voices.values())
        return sum(voice.caches.nbytes() for voice in voices)

    def describe(self) -> list[dict[str, object]]:
        with self._lock:
            return [voice.describe() for voice in self._voices.values()]

    def add(self, voice: Voice, *, persist: bool = True) -> Voice:
        with self._lock:
            if voice.voice_id in self._voices:
                raise VoiceExistsError(f"voice {voice.voice_id!r} already exists")
            if persist and self.store is not None:
                self.store.save(voice)
                voice.source = "store"
            self._voices[voice.voice_id] = voice
        logger.info(
            "voice %s registered (%s, %d prompt tokens)", voice.voice_id, voice.kind, voice.prompt_tokens
        )
        return voice

    def register(
        self, clip: Clip, transcript: str | None, voice_id: str | None = None, name: str = ""
    ) -> Voice:
        """A zero-shot (or, without transcript, cross-lingual) voice from a checked clip; persisted."""
        return self.install(self.prepare(clip, transcript, voice_id, name))

    def prepare(
        self,
        clip: Clip,
        transcript: str | None,
        voice_id: str | None = None,
        name: str = "",
        prep: TextPrep | None = None,
    ) -> VoiceFeatures:
        """The clip's features for `install` (any thread: the model's feature extractors only)."""
        if voice_id is None:
            voice_id = free_voice_id(name, set(self.ids()))
        elif voice_id in self.ids():
            raise VoiceExistsError(f"voice {voice_id!r} already exists")
        return voice_features(self.model, clip, transcript, voice_id, name=name, prep=prep)

    def install(self, features: VoiceFeatures) -> Voice:
        """Engine thread: the voice's model state from prepared features; persisted and listed."""
        return run_to_end(self.install_parts(features))

    def install_parts(self, features: VoiceFeatures) -> Parts[Voice]:
        """`install` in bounded parts (engine thread, each part under the device's compute context):
        the id and the prompt are checked now (before any model work; InputError / VoiceExistsError),
        the prompt caches are built a part at a time, and the voice is persisted and listed once they
        are complete (only then is it visible)."""
        if features.voice_id is not None and features.voice_id in self.ids():  # registered meanwhile
            raise VoiceExistsError(f"voice {features.voice_id!r} already exists")
        voice = voice_install(self.model, features, lazy=True)
        voice.caches.check()
        return self._installed(voice)

    def _installed(self, voice: Voice) -> Parts[Voice]:
        while not voice.caches.advance():
            yield
        return self.add(voice)

    def register_wav(self, path: str | Path, transcript: str | None, voice_id: str | None = None) -> Voice:
        if voice_id is not None and voice_id in self.ids():
            raise VoiceExistsError(f"voice {voice_id!r} already exists")
        return self.add(voice_from_wav(self.model, path, transcript, voice_id))

    def delete(self, voice_id: str) -> None:
        with self._lock:
            voice = self._voices.get(voice_id)
            if voice is None:
                raise UnknownVoiceError(f"unknown voice {voice_id!r}")
            if voice.source == "spk2info":
                raise VoiceReadOnlyError(f"voice {voice_id!r} comes from spk2info.pt and cannot be deleted")
            if self.store is not None:
                self.store.delete(voice_id)
            del self._voices[voice_id]
        freed = voice.caches.nbytes()  # returned once no utterance of the voice is left
        logger.info("voice %s deleted (%.1f MB of prompt caches)", voice_id, freed / 1e6)
