"""The speech queue of one call: utterances play in order, one synthesizes at a time, interrupt clears all.

Runs on the event loop. Engine events arrive on the engine thread and hop over with
`loop.call_soon_threadsafe`; playout callbacks come from the track (already on the loop). Every
utterance ends in exactly one terminal client event: `speech.done`, `speech.interrupted` or `error`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field
from typing import Any

from voicertc.engine.protocol import AudioSink, Cancelled, Done, Engine, EngineEvent, Failed, FirstAudio
from voicertc.errors import InputError, VoiceRTCError

logger = logging.getLogger(__name__)

ClientEvent = dict[str, Any]
EmitFn = Callable[[ClientEvent], None]


class TextTooLongError(InputError):
    code = "text_too_long"


@dataclass
class SpeechHandle:
    """One utterance of a call, as its speaker sees it. Owned by the event loop.

    `state` goes queued -> synthesizing -> synthesized -> (done | interrupted | failed); text arriving
    before the utterance's turn is held in `pending_text`.
    """

    utterance_id: str
    voice: str | None
    requested_s: float  # loop time of the speak request
    state: str = "queued"
    pending_text: list[str] = field(default_factory=list)
    input_ended: bool = False
    text_chars: int = 0
    started: bool = False
    terminal: asyncio.Future[ClientEvent] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    feeder: asyncio.Task[None] | None = None

    @property
    def finished(self) -> bool:
        return self.terminal.done()

    async def done(self) -> ClientEvent:
        """Wait for the terminal event (`speech.done`, `speech.interrupted` or `error`) and return it."""
        return await asyncio.shield(self.terminal)


class SpeechQueue:
    """Orders a call's utterances onto one sink: the engine sees at most one open utterance per call.

    The next utterance opens when the engine has put all audio of the previous one into the sink, so
    synthesis overlaps playback but the ring never interleaves two utterances.
    """

    def __init__(
        self, engine: Engine, sink: AudioSink, emit: EmitFn, *, max_text_chars: int, call_id: str
    ) -> None:
        self.engine = engine
        self.sink = sink
        self.emit = emit
        self.max_text_chars = max_text_chars
        self.call_id = call_id
        self._loop = asyncio.get_running_loop()
        self._queue: deque[SpeechHandle] = deque()
        self._active: SpeechHandle | None = None  # open in the engine
        self._by_id: dict[str, SpeechHandle] = {}  # not yet terminal
        self.on_first_audio: Callable[[SpeechHandle, float], None] | None = None

    # --- requests ---------------------------------------------------------------------------------

    def speak(self, text: str | AsyncIterable[str], voice: str | None = None) -> SpeechHandle:
        """Queue an utterance of a whole text or of an async stream of text deltas."""
        if isinstance(text, str):
            if not text.strip():
                raise InputError("empty text: nothing to speak")
            if len(text) > self.max_text_chars:
                raise TextTooLongError(f"text too long: {len(text)} characters (limit {self.max_text_chars})")
        handle = SpeechHandle(uuid.uuid4().hex[:12], voice, self._loop.time())
        self._by_id[handle.utterance_id] = handle
        self._queue.append(handle)
        if isinstance(text, str):
            self.push(handle, text)
            self.end_input(handle)
        else:
            handle.feeder = self._loop.create_task(self._feed(handle, text))
        self._pump()
        return handle

    async def _feed(self, handle: SpeechHandle, deltas: AsyncIterable[str]) -> None:
        try:
            async for delta in deltas:
                if handle.finished:
                    return
                self.push(handle, delta)
        except asyncio.CancelledError:
            raise
        except VoiceRTCError as exc:
            self.fail(handle, exc.code, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a broken text stream fails its utterance only
            self.fail(handle, "bad_input", f"text stream failed: {type(exc).__name__}: {exc}")
            return
        self.end_input(handle)

    def push(self, handle: SpeechHandle, delta: str) -> None:
        if handle.finished or handle.input_ended:
            return
        if not isinstance(delta, str):
            raise InputError(f"text delta must be a string, got {type(delta).__name__}")
        handle.text_chars += len(delta)
        if handle.text_chars > self.max_text_chars:
            self.fail(handle, "text_too_long", f"text too long: more than {self.max_text_chars} characters")
            return
        if handle is self._active:
            self.engine.push_text(handle.utterance_id, delta)
        else:
            handle.pending_text.append(delta)

    def end_input(self, handle: SpeechHandle) -> None:
        if handle.finished or handle.input_ended:
            return
        handle.input_ended = True
        if handle is self._active:
            self.engine.end_input(handle.utterance_id)

    # --- moving the queue -------------------------------------------------------------------------

    def _pump(self) -> None:
        while self._active is None and self._queue:
            handle = self._queue.popleft()
            if handle.finished:
                continue
            try:
                self.engine.open_utterance(
                    handle.voice, self.sink, self._on_engine_event, handle.utterance_id
                )
            except VoiceRTCError as exc:
                self.fail(handle, exc.code, str(exc))
                continue
            self._active = handle
            handle.state = "synthesizing"
            for delta in handle.pending_text:
                self.engine.push_text(handle.utterance_id, delta)
            handle.pending_text.clear()
            if handle.input_ended:
                self.engine.end_input(handle.utterance_id)

    def _release_active(self, handle: SpeechHandle) -> None:
        if self._active is handle:
            self._active = None
            self._pump()

    def _on_engine_event(self, event: EngineEvent) -> None:
        """Engine thread: hop to the loop."""
        try:
            self._loop.call_soon_threadsafe(self._handle_engine_event, event)
        except RuntimeError:
            pass  # the loop is closed: the call is gone

    def _handle_engine_event(self, event: EngineEvent) -> None:
        handle = self._by_id.get(event.utterance_id)
        if handle is None:
            return
        if isinstance(event, FirstAudio):
            if self.on_first_audio is not None:
                self.on_first_audio(handle, event.ttfa_ms)
        elif isinstance(event, Done):
            handle.state = "synthesized"
            logger.debug(
                "call %s utterance %s synthesized (%.0f ms)",
                self.call_id,
                handle.utterance_id,
                event.audio_ms,
            )
            self._release_active(handle)
        elif isinstance(event, Failed):
            self.fail(handle, event.code, event.message)
        elif isinstance(event, Cancelled):
            self._release_active(handle)

    # --- terminal events --------------------------------------------------------------------------

    def get(self, utterance_id: str) -> SpeechHandle | None:
        return self._by_id.get(utterance_id)

    def playout_started(self, utterance_id: str) -> ClientEvent | None:
        """The track sent the utterance's first frame: `speech.started` with the time since the request."""
        handle = self._by_id.get(utterance_id)
        if handle is None or handle.started:
            return None
        handle.started = True
        ttfa_ms = 1000.0 * (self._loop.time() - handle.requested_s)
        event = {"type": "speech.started", "utterance_id": utterance_id, "ttfa_ms": round(ttfa_ms, 1)}
        self.emit(event)
        return event

    def playout_done(self, utterance_id: str, played_ms: float) -> None:
        handle = self._by_id.get(utterance_id)
        if handle is None:
            return
        if not handle.started:
            self.playout_started(utterance_id)
        self._finish(
            handle, {"type": "speech.done", "utterance_id": utterance_id, "played_ms": round(played_ms, 1)}
        )
        self._release_active(handle)  # its end mark was played, so the engine is done with it

    def fail(self, handle: SpeechHandle, code: str, message: str) -> None:
        if handle.finished:
            return
        self.engine.cancel(handle.utterance_id)
        self._finish(
            handle, {"type": "error", "utterance_id": handle.utterance_id, "code": code, "message": message}
        )
        self._release_active(handle)

    def interrupt_all(self, playing_id: str | None, played_ms: float) -> tuple[str | None, float]:
        """Cancel every unfinished utterance; the one playing reports `played_ms`, the others 0.

        Returns the utterance the interrupt is about: the one playing, else the oldest unfinished one.
        """
        victims = [h for h in self._by_id.values() if not h.finished]
        self._queue.clear()
        active, self._active = self._active, None
        if active is not None:
            self.engine.cancel(active.utterance_id)
        about = playing_id if playing_id in self._by_id else (victims[0].utterance_id if victims else None)
        for handle in victims:
            ms = played_ms if handle.utterance_id == playing_id else 0.0
            self._finish(
                handle,
                {
                    "type": "speech.interrupted",
                    "utterance_id": handle.utterance_id,
                    "played_ms": round(ms, 1),
                },
            )
        return about, (played_ms if about == playing_id else 0.0)

    def _finish(self, handle: SpeechHandle, event: ClientEvent) -> None:
        if handle.finished:
            return
        handle.state = event["type"].removeprefix("speech.")
        self._by_id.pop(handle.utterance_id, None)
        if (
            handle.feeder is not None
            and not handle.feeder.done()
            and handle.feeder is not asyncio.current_task()
        ):
            handle.feeder.cancel()
        handle.terminal.set_result(event)
        self.emit(event)

    def close(self) -> None:
        """Cancel everything without events to a client that is gone; engine state is freed by cancel."""
        for handle in list(self._by_id.values()):
            self.engine.cancel(handle.utterance_id)
            if handle.feeder is not None and not handle.feeder.done():
                handle.feeder.cancel()
            if not handle.terminal.done():
                handle.terminal.set_result(
                    {"type": "speech.interrupted", "utterance_id": handle.utterance_id, "played_ms": 0.0}
                )
        self._by_id.clear()
        self._queue.clear()
        self._active = None

    @property
    def pending(self) -> int:
        return len(self._by_id)
