"""The voice-book capability: list, register and delete voices, as engine commands.

A backend that keeps voices of its own declares `voice_book` (an object with the methods of
`BackendVoiceBook`, usually the backend itself); one that does not (Piper, the fake unless `[fake]
voice_book`) declares None and still lists its built-in voices. The functions here are the commands
the worker runs on its engine thread (`Engine.list_voices` / `register_voice` / `delete_voice`), so a
registered voice is usable the moment the future resolves. `check_prompt` is what every voice book
checks of a clip before any work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from voicertc.engine.parts import InParts
from voicertc.errors import InputError, NotSupportedError, UnknownVoiceError
from voicertc.voice_ids import check_voice_id

if TYPE_CHECKING:
    from voicertc.audio.decode import Clip

VoiceInfo = dict[str, Any]

MIN_PROMPT_S, MAX_PROMPT_S = 1.0, 30.0  # the speech tokenizer's window (30 s)
MAX_TRANSCRIPT_CHARS_PER_S = 50  # a prompt transcript longer than this per second of clip is refused


class BackendVoiceBook(Protocol):
    """What a backend that registers voices offers (engine thread only)."""

    def voice_infos(self) -> list[VoiceInfo]: ...

    def register_clip(self, clip: Clip, transcript: str | None, voice_id: str | None, name: str) -> VoiceInfo:
        """A zero-shot voice from a decoded clip; InputError / VoiceExistsError name the problem."""
        ...

    def prepare_clip(self, clip: Clip, transcript: str | None, voice_id: str | None, name: str) -> object:
        """Off the engine thread (the worker's voice-preparation thread): the clip's features, for
        `install_voice`; no engine state is touched."""
        ...

    def install_voice(self, prepared: object) -> VoiceInfo | InParts[VoiceInfo]:
        """Engine thread: the prepared voice's model state, listed and persisted; its description (or
        `InParts` giving it, when the model state takes longer than an engine unit may)."""
        ...

    def delete_voice(self, voice_id: str) -> None: ...


def check_prompt(clip: Clip, transcript: str | None, voice_id: str | None) -> str:
    """The stripped transcript of a prompt clip a voice book may register; InputError before any work
    for a bad id, a clip outside MIN_PROMPT_S..MAX_PROMPT_S, or a transcript longer than the clip can
    say (MAX_TRANSCRIPT_CHARS_PER_S, at least 100 characters)."""
    if voice_id is not None:
        check_voice_id(voice_id)
    if not MIN_PROMPT_S <= clip.seconds <= MAX_PROMPT_S:
        raise InputError(
            f"prompt audio is {clip.seconds:.2f} s; it must be {MIN_PROMPT_S:g}-{MAX_PROMPT_S:g} s"
        )
    text = (transcript or "").strip()
    limit = max(100, int(MAX_TRANSCRIPT_CHARS_PER_S * clip.seconds))
    if len(text) > limit:
        raise InputError(
            f"the prompt transcript has {len(text)} characters for a {clip.seconds:.1f} s clip; "
            f"at most {limit} ({MAX_TRANSCRIPT_CHARS_PER_S} per second)"
        )
    return text


class HasVoices(Protocol):
    """What these commands need of a backend (every backend shape has it)."""

    name: str
    voice_book: BackendVoiceBook | None

    def voices(self) -> list[str]: ...


def builtin_info(voice_id: str) -> VoiceInfo:
    """The description of a voice that came with the engine (not deletable)."""
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


def list_voices(backend: HasVoices) -> list[VoiceInfo]:
    book = backend.voice_book
    return book.voice_infos() if book is not None else [builtin_info(v) for v in backend.voices()]


def register_voice(
    backend: HasVoices, clip: Clip, transcript: str | None, voice_id: str | None, name: str
) -> VoiceInfo:
    book = backend.voice_book
    if book is None:
        raise NotSupportedError(f"registering voices is not supported by this engine ({backend.name})")
    return book.register_clip(clip, transcript, voice_id, name)


def voice_book_of(backend: HasVoices) -> BackendVoiceBook:
    """The backend's voice book; NotSupportedError when it cannot register voices."""
    book = backend.voice_book
    if book is None:
        raise NotSupportedError(f"registering voices is not supported by this engine ({backend.name})")
    return book


def delete_voice(backend: HasVoices, voice_id: str) -> None:
    book = backend.voice_book
    if book is None:
        if voice_id in backend.voices():
            raise NotSupportedError(f"deleting voices is not supported by this engine ({backend.name})")
        raise UnknownVoiceError(f"unknown voice {voice_id!r}")
    book.delete_voice(voice_id)
