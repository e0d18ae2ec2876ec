"""The fake engine's voice book: registered voices kept in memory, checked as CosyVoice2 checks them.

With `[fake] voice_book = true` the fake engine registers, lists, speaks with (its tone) and deletes
voices through the same engine commands and with the same errors as the CosyVoice2 backend: a bad id,
a clip outside 1-30 s or a transcript longer than the clip can say is `bad_input`, a taken id
`voice_exists`, a built-in voice `voice_read_only`, a missing one `unknown_voice`. Nothing is persisted
and no features are computed, so transport and API tests get the whole voice API without a model.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from voicertc.engine.voice_book import VoiceInfo, builtin_info, check_prompt
from voicertc.errors import UnknownVoiceError, VoiceExistsError, VoiceReadOnlyError
from voicertc.voice_ids import free_voice_id

if TYPE_CHECKING:
    from voicertc.audio.decode import Clip

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FakeVoice:
    """A registered voice: what the API lists about it (the fake speaks every voice with its tone)."""

    voice_id: str
    name: str
    transcript: str
    prompt_s: float
    created_s: float = 0.0

    def describe(self) -> VoiceInfo:
        return {
            "id": self.voice_id,
            "name": self.name or self.voice_id,
            "kind": "zero_shot" if self.transcript else "cross_lingual",
            "transcript": self.transcript,
            "prompt_s": round(self.prompt_s, 2),
            "source": "memory",
            "deletable": True,
            "created_at": int(self.created_s) if self.created_s else None,
        }


class FakeVoiceBook:
    """The built-in voices plus registered ones, by id. Thread-safe: `ids` is read from any thread,
    the rest runs as engine commands (and `prepare_clip` on the worker's voice-preparation thread)."""

    def __init__(self, builtin_ids: list[str]) -> None:
        self.builtin_ids = list(builtin_ids)
        self._lock = threading.Lock()
        self._registered: dict[str, FakeVoice] = {}

    def ids(self) -> list[str]:
        with self._lock:
            return [*self.builtin_ids, *self._registered]

    def voice_infos(self) -> list[VoiceInfo]:
        with self._lock:
            registered = list(self._registered.values())
        return [builtin_info(v) for v in self.builtin_ids] + [voice.describe() for voice in registered]

    def prepare_clip(self, clip: Clip, transcript: str | None, voice_id: str | None, name: str) -> FakeVoice:
        if voice_id is None:
            voice_id = free_voice_id(name, set(self.ids()))
        elif voice_id in self.ids():
            raise VoiceExistsError(f"voice {voice_id!r} already exists")
        text = check_prompt(clip, transcript, voice_id)
        return FakeVoice(voice_id, name, text, clip.seconds)

    def install_voice(self, prepared: object) -> VoiceInfo:
        if not isinstance(prepared, FakeVoice):
            raise TypeError(f"not a prepared fake voice: {type(prepared).__name__}")
        voice = FakeVoice(
            prepared.voice_id, prepared.name, prepared.transcript, prepared.prompt_s, time.time()
        )
        with self._lock:
            if (
                voice.voice_id in self.builtin_ids or voice.voice_id in self._registered
            ):  # registered meanwhile
                raise VoiceExistsError(f"voice {voice.voice_id!r} already exists")
            self._registered[voice.voice_id] = voice
        logger.info("voice %s registered on the fake engine (%.2f s clip)", voice.voice_id, voice.prompt_s)
        return voice.describe()

    def register_clip(self, clip: Clip, transcript: str | None, voice_id: str | None, name: str) -> VoiceInfo:
        return self.install_voice(self.prepare_clip(clip, transcript, voice_id, name))

    def delete_voice(self, voice_id: str) -> None:
        with self._lock:
            if voice_id in self.builtin_ids:
                raise VoiceReadOnlyError(
                    f"voice {voice_id!r} comes with the fake engine and cannot be deleted"
                )
            if self._registered.pop(voice_id, None) is None:
                raise UnknownVoiceError(f"unknown voice {voice_id!r}")
        logger.info("voice %s deleted from the fake engine", voice_id)
