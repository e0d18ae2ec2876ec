"""The voice registry as the HTTP API and the embedding API (`server.voices`) see it.

Owned by the event loop. Audio is decoded and checked in a worker thread; everything that touches the
backend (listing with details, registration, deletion) is an engine command (`submit_command`), so it
runs on the engine thread between steps and a registered voice is usable the moment the future
resolves. Engines that cannot register voices (Piper, the fake) still list theirs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from voicertc.audio.decode import Clip, ClipLimits, load_clip
from voicertc.config import LimitsConfig
from voicertc.engine.protocol import Engine
from voicertc.errors import InputError, UnknownVoiceError, VoiceRTCError
from voicertc.voice_ids import check_voice_id

logger = logging.getLogger(__name__)

T = TypeVar("T")
VoiceInfo = dict[str, Any]


class NotSupportedError(VoiceRTCError):
    """The engine cannot do this (e.g. Piper registering a voice)."""

    code = "not_supported"


def builtin_info(voice_id: str) -> VoiceInfo:
    return {
        "id": voice_id,
        "name": voice_id,
        "kind": "builtin",
        "transcript": "",
        "prompt_s": 0.0,
        "source": "engine",
        "deletable": False,
        "created_at": None,
    }


def _list(backend: Any) -> list[VoiceInfo]:
    describe = getattr(backend, "voice_infos", None)
    return describe() if describe is not None else [builtin_info(v) for v in backend.voices()]


def _register(
    clip: Clip, transcript: str | None, voice_id: str | None, name: str
) -> Callable[[Any], VoiceInfo]:
    def register(backend: Any) -> VoiceInfo:
        if not hasattr(backend, "register_clip"):
            raise NotSupportedError(f"registering voices is not supported by this engine ({backend.name})")
        return backend.register_clip(clip, transcript, voice_id, name)

    return register


def _delete(voice_id: str) -> Callable[[Any], None]:
    def delete(backend: Any) -> None:
        if not hasattr(backend, "delete_voice"):
            if voice_id in backend.voices():
                raise NotSupportedError(f"deleting voices is not supported by this engine ({backend.name})")
            raise UnknownVoiceError(f"unknown voice {voice_id!r}")
        backend.delete_voice(voice_id)

    return delete


class VoiceAdmin:
    """List, inspect, register and delete voices (`server.voices`; the /v1/voices routes use it too)."""

    def __init__(self, engine: Engine, limits: LimitsConfig) -> None:
        self.engine = engine
        self.limits = ClipLimits(
            min_s=limits.voice_min_s, max_s=limits.voice_max_s, max_bytes=limits.voice_max_bytes
        )
        self.max_transcript_chars = limits.max_text_chars

    async def _command(self, fn: Callable[[Any], T]) -> T:
        submit = getattr(self.engine, "submit_command", None)
        if submit is None:
            raise NotSupportedError("this engine takes no commands")
        return await asyncio.wrap_future(submit(fn))

    async def list(self) -> list[VoiceInfo]:
        """Every voice the engine has, with what is known about it."""
        return await self._command(_list)

    async def get(self, voice_id: str) -> VoiceInfo:
        for info in await self.list():
            if info["id"] == voice_id:
                return info
        raise UnknownVoiceError(f"unknown voice {voice_id!r}")

    async def register(
        self,
        audio: bytes | str | Path,
        transcript: str | None = None,
        *,
        voice_id: str | None = None,
        name: str | None = None,
    ) -> VoiceInfo:
        """A zero-shot voice from a clip (bytes of wav/flac/ogg/opus/mp3/webm, or a file path) and its
        transcript; without a transcript a cross-lingual voice. Usable at once; persisted."""
        if transcript is not None and len(transcript) > self.max_transcript_chars:
            raise InputError(
                f"the transcript has {len(transcript)} characters; the limit is {self.max_transcript_chars}"
            )
        if voice_id is not None:
            check_voice_id(voice_id)
        data = audio if isinstance(audio, bytes) else await asyncio.to_thread(Path(audio).read_bytes)
        clip = await asyncio.to_thread(load_clip, data, self.limits)
        info = await self._command(_register(clip, transcript, voice_id, (name or "").strip()))
        logger.info("voice %s registered over the API (%.1f s clip)", info["id"], clip.seconds)
        return info

    async def delete(self, voice_id: str) -> None:
        await self._command(_delete(voice_id))
