"""The engine seam: what the transport may ask of an engine, and what it hears back.

The transport (WebRTC call, HTTP API, an agent in-process) depends on this module and on
`voicertc.audio`, nothing else of the engine. Messages crossing threads are frozen dataclasses.

Threads: `Engine` methods are safe to call from any thread (they enqueue a command and return).
`on_event` callbacks and `AudioSink.write` run on the engine's worker thread; the sink's reader
(the WebRTC track) runs on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from voicertc.audio.decode import Clip
    from voicertc.engine.batch_stats import BatchStats
    from voicertc.engine.step_stats import StepStats
    from voicertc.engine.voice_book import VoiceInfo

T = TypeVar("T")

# --- events: engine -> caller --------------------------------------------------------------------


@dataclass(frozen=True)
class FirstAudio:
    """The first PCM of an utterance reached its sink."""

    utterance_id: str
    ttfa_ms: float  # from the utterance's first text to its first PCM in the sink


@dataclass(frozen=True)
class Done:
    """All of the utterance's audio is in its sink (playback may still be running)."""

    utterance_id: str
    audio_ms: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Cancelled:
    utterance_id: str


@dataclass(frozen=True)
class Failed:
    utterance_id: str
    code: str  # e.g. "bad_input", "unknown_voice", "synthesis_error", "text_too_long"
    message: str


EngineEvent = FirstAudio | Done | Cancelled | Failed
EventCallback = Callable[[EngineEvent], None]

# --- commands: caller -> engine worker (internal queue messages) ---------------------------------


@dataclass(frozen=True)
class SpeakOptions:
    """How to speak an utterance beyond its voice (backends that cannot honour one are refused at the edge).

    `instruct`: an instruction for the voice (CosyVoice2 instruct2: "speak cheerfully", "用四川话说这句话").
    `speed`: a speaking-rate factor; the reference changes speed only in non-streaming synthesis, so a
    backend that honours it synthesizes such an utterance without streaming (CosyVoice2).
    """

    instruct: str = ""
    speed: float = 1.0

    def __bool__(self) -> bool:
        return bool(self.instruct) or self.speed != 1.0


DEFAULT_OPTIONS = SpeakOptions()


@dataclass(frozen=True)
class OpenUtterance:
    utterance_id: str
    voice: str
    sink: AudioSink
    on_event: EventCallback
    generation: int  # sink generation at open; writes after a clear() of the sink are dropped
    options: SpeakOptions = DEFAULT_OPTIONS


@dataclass(frozen=True)
class PushText:
    utterance_id: str
    text: str
    end: bool = False  # the last text: applied with it in one command (a whole text is seen whole)


@dataclass(frozen=True)
class EndInput:
    utterance_id: str


@dataclass(frozen=True)
class Cancel:
    utterance_id: str


@dataclass(frozen=True)
class Wake:
    """A sink has room again (or anything else that may make work runnable)."""


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class RunCommand:
    """Run `fn(backend)` on the engine thread between steps; its result or exception goes to `future`."""

    fn: Callable[[Any], Any]
    future: Future[Any]


Command = OpenUtterance | PushText | EndInput | Cancel | Wake | Stop | RunCommand


# --- the sink the engine writes into --------------------------------------------------------------


@runtime_checkable
class AudioSink(Protocol):
    """Where an utterance's PCM goes. Implemented by `voicertc.audio.RingSink`.

    Written from the engine thread, read (played out) elsewhere. Backpressure: the engine writes
    only while `has_room()`; the reader calls the space listener when room frees up again.
    """

    @property
    def generation(self) -> int:
        """Bumped by every clear() (interrupt); the engine tags its writes with the value at open."""
        ...

    @property
    def queued_ms(self) -> float:
        """Audio queued and not yet played out (the scheduler serves the emptiest sinks first)."""
        ...

    def write(self, pcm: np.ndarray, sample_rate_hz: int, utterance_id: str, generation: int) -> bool:
        """Queue float32 mono PCM in [-1, 1] at any rate. False (and dropped) if `generation` is stale."""
        ...

    def end_utterance(self, utterance_id: str, generation: int) -> None:
        """No more audio for this utterance: flush the resampler and mark the end for playback."""
        ...

    def mark_text(self, utterance_id: str, generation: int, text: str) -> None:
        """The text whose audio starts with the next write (what the listener heard; may be ignored)."""
        ...

    def abort_utterance(self, utterance_id: str, generation: int) -> None:
        """The utterance ended early (failed or cancelled): free its state and mark its end."""
        ...

    def has_room(self) -> bool:
        """Below the high-water mark: the engine may write another piece."""
        ...

    def set_space_listener(self, callback: Callable[[], None] | None) -> None:
        """`callback()` is called (from the reader's thread) when `has_room()` turns true again."""
        ...


# --- the engine ------------------------------------------------------------------------------------


class Engine(Protocol):
    """Text in, PCM out, per utterance; one worker thread behind it (or a remote engine's client).

    Everything here may be called from any thread; the engine's own thread runs the model. Callers
    never probe for members: what an engine can do is declared (`supports`, the voice book)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def voices(self) -> list[str]: ...

    @property
    def running(self) -> bool:
        """Started and not stopped (its worker thread alive, or the remote client connected)."""
        ...

    @property
    def ready(self) -> bool:
        """Loaded, warmed up and accepting utterances (`/readyz`)."""
        ...

    @property
    def not_ready_reason(self) -> str:
        """Why `ready` is false, in one line ("" when it is true)."""
        ...

    @property
    def retry_after_s(self) -> int:
        """What a 503 for not being ready tells the client to wait (`Retry-After`)."""
        ...

    def resolve_voice(self, voice: str | None) -> str:
        """The voice id to use for `voice` (None/"" = default); UnknownVoiceError names a bad one."""
        ...

    def supports(self, feature: str) -> bool:
        """Whether the engine honours a speak option ("instruct", "speed")."""
        ...

    def submit_command(self, fn: Callable[[Any], T]) -> Future[T]:
        """Run `fn(backend)` on the engine thread between steps (in-process engines; a remote one
        fails the future with NotSupportedError)."""
        ...

    # --- the voice book: list / register / delete, each run on the engine thread ----------------------

    def list_voices(self) -> Future[list[VoiceInfo]]:
        """Every voice with what is known about it (`voice_book.builtin_info` for built-in ones)."""
        ...

    def register_voice(
        self, clip: Clip, transcript: str | None, voice_id: str | None, name: str
    ) -> Future[VoiceInfo]:
        """A zero-shot voice from a decoded, checked clip (NotSupportedError where it cannot)."""
        ...

    def delete_voice(self, voice_id: str) -> Future[None]: ...

    @property
    def step_stats(self) -> StepStats | None:
        """Engine step times (/metrics), None where the steps run elsewhere."""
        ...

    @property
    def batch_stats(self) -> BatchStats | None:
        """Batch sizes per stage (/metrics), None where the batches run elsewhere."""
        ...

    @property
    def open_count(self) -> int:
        """Utterances opened and not yet ended; drops the moment `cancel()` is called (thread-safe)."""
        ...

    @property
    def max_utterances(self) -> int:
        """The open-utterance limit: `open_utterance` raises InputError once `open_count` reaches it."""
        ...

    def open_utterance(
        self,
        voice: str | None,
        sink: AudioSink,
        on_event: EventCallback,
        utterance_id: str | None = None,
        options: SpeakOptions | None = None,
    ) -> str:
        """Open an utterance on `voice` (None = default) writing into `sink`; returns its id. `options`
        (instruct / speed) is passed only when set, so an engine without the parameter still works."""
        ...

    def push_text(self, utterance_id: str, text: str, end: bool = False) -> None:
        """Append text (a whole text, or one delta of an LLM stream). `end=True`: no more text follows
        (as `end_input`, in the same command): a text known whole must be pushed so, never as a push
        and a separate end, or the engine may start it as a stream of deltas between the two."""
        ...

    def end_input(self, utterance_id: str) -> None:
        """No more text will come; the utterance finishes after what it has."""
        ...

    def cancel(self, utterance_id: str) -> None:
        """Stop synthesizing; exactly one Cancelled (or an earlier terminal event) follows."""
        ...

    def say(self, voice: str | None, sink: AudioSink, on_event: EventCallback, text: str) -> str:
        """open_utterance + push_text(end=True)."""
        ...
