"""The voice registry as the HTTP API and the embedding API (`server.voices`) see it.

Owned by the event loop. Audio is decoded and checked in a worker thread; everything that touches the
backend (listing with details, registration, deletion) goes through the engine's declared voice book
(`Engine.list_voices` / `register_voice` / `delete_voice`), which runs it on the engine thread between
steps, so a registered voice is usable the moment the future resolves. Engines that cannot register
voices (Piper, the fake) still list theirs.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from voicertc.audio.decode import ClipLimits, load_clip
from voicertc.config import LimitsConfig
from voicertc.engine.protocol import Engine
from voicertc.engine.voice_book import VoiceInfo, builtin_info
from voicertc.errors import InputError, NotSupportedError, UnknownVoiceError
from voicertc.voice_ids import check_voice_id

logger = logging.getLogger(__name__)

__all__ = ["NotSupportedError", "VoiceAdmin", "VoiceInfo", "builtin_info"]


class VoiceAdmin:
    """List, inspect, register and delete voices (`server.voices`; the /v1/voices routes use it too)."""

    def __init__(self, engine: Engine, limits: LimitsConfig) -> None:
        self.engine = engine
        self.limits = ClipLimits(
            min_s=limits.voice_min_s, max_s=limits.voice_max_s, max_bytes=limits.voice_max_bytes
        )
        self.max_transcript_chars = limits.max_text_chars

    async def list(self) -> list[VoiceInfo]:
        """Every voice the engine has, with what is known about it."""
        return await asyncio.wrap_future(self.engine.list_voices())

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
        registered = self.engine.register_voice(clip, transcript, voice_id, (name or "").strip())
        info = await asyncio.wrap_future(registered)
        logger.info("voice %s registered over the API (%.1f s clip)", info["id"], clip.seconds)
        return info

    async def delete(self, voice_id: str) -> None:
        await asyncio.wrap_future(self.engine.delete_voice(voice_id))
