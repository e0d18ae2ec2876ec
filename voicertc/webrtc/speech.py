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
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from voicertc.config import LimitsConfig
from voicertc.engine.protocol import (
    AudioSink,
    Cancelled,
    Done,
    Engine,
    EngineEvent,
    Failed,
    FirstAudio,
    SpeakOptions,
)
from voicertc.errors import EngineStoppedError, EngineUnavailableError, InputError, VoiceRTCError
from voicertc.validate import SpeakRequest, SpeakRules, check_text

logger = logging.getLogger(__name__)

ClientEvent = dict[str, Any]
EmitFn = Callable[[ClientEvent], None]


def speak_rules(engine: Engine, limits: LimitsConfig, voices: list[str] | None = None) -> SpeakRules:
    """What `SpeakRequest.parse` checks a request against on this engine: its options, and the voices
    the caller may use (`voices`; default: every voice of the engine)."""
    voices = engine.voices() if voices is None else voices
    return SpeakRules(max_text_chars=limits.max_text_chars, voices=voices, features=engine_features(engine))


def engine_features(engine: Engine) -> list[str]:
    """The speak options the engine honours."""
    return [f for f in ("instruct", "speed") if engine.supports(f)]


def speak_options(engine: Engine, instruct: object = None, speed: object = None) -> SpeakOptions:
    """Checked instruct / speed alone (a session's settings): `SpeakRequest.parse` of those two fields."""
    rules = SpeakRules(max_text_chars=1, voices=None, features=engine_features(engine))
    request = SpeakRequest.parse({"instruct": instruct, "speed": speed}, rules, streamed=True)
    return SpeakOptions(instruct=request.instruct, speed=request.speed)


class QueueFullError(VoiceRTCError):
    """A call already has `limits.max_queued_utterances` unfinished utterances (HTTP 429)."""

    code = "too_many_utterances"


class EngineBusyError(QueueFullError):
    """The engine has `limits.max_utterances` open utterances and this one would open now (HTTP 429)."""

    code = "engine_busy"


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
    active_s: float | None = None  # loop time it was opened in the engine
    pending_text: list[str] = field(default_factory=list)
    input_ended: bool = False
    text_chars: int = 0
    started: bool = False
    terminal: asyncio.Future[ClientEvent] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    feeder: asyncio.Task[None] | None = None
    options: SpeakOptions | None = None  # instruct / speed, when the request set them

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
        self, engine: Engine, sink: AudioSink, emit: EmitFn, *, limits: LimitsConfig, call_id: str
    ) -> None:
        self.engine = engine
        self.sink = sink
        self.emit = emit
        self.max_text_chars = limits.max_text_chars
        self.max_queued = limits.max_queued_utterances
        self.text_idle_timeout_s = limits.text_idle_timeout_s
        self.call_id = call_id
        self._loop = asyncio.get_running_loop()
        self._queue: deque[SpeechHandle] = deque()
        self._active: SpeechHandle | None = None  # open in the engine
        self._by_id: dict[str, SpeechHandle] = {}  # not yet terminal
        self._playout_idle_s = 0.0  # loop time the last utterance's playout ended
        self.on_first_audio: Callable[[SpeechHandle, float], None] | None = None
        self.on_synthesized: Callable[[dict[str, float]], None] | None = None  # engine metrics hook

    # --- requests ---------------------------------------------------------------------------------

    def check_engine(self) -> None:
        """Raise what `speak` would raise for the engine's state (stopped, unavailable) without queueing
        anything, so a caller can check before it interrupts. The request itself was checked where it
        entered (`SpeakRequest.parse`)."""
        if not self.engine.running:
            raise EngineStoppedError("the engine is not running")
        if not self.engine.ready:
            reason = self.engine.not_ready_reason or "the engine is not ready"
            raise EngineUnavailableError(reason, self.engine.retry_after_s)

    def check(self) -> None:
        """`check_engine`, and room in this call's queue and in the engine."""
        self.check_engine()
        if len(self._by_id) >= self.max_queued:
            raise QueueFullError(
                f"{len(self._by_id)} utterances are already queued or playing on this call "
                f"(limits.max_queued_utterances = {self.max_queued})"
            )
        self._check_engine_room()

    def speak(
        self, text: str | AsyncIterable[str], voice: str | None = None, options: SpeakOptions | None = None
    ) -> SpeechHandle:
        """Queue an utterance of a whole text or of an async stream of text deltas (both checked at the
        edge: `SpeakRequest.parse`, deltas by `push` as they arrive)."""
        self.check()
        handle = SpeechHandle(uuid.uuid4().hex[:12], voice, self._loop.time())
        handle.options = options or None
        self._by_id[handle.utterance_id] = handle
        self._queue.append(handle)
        self.emit({"type": "speech.queued", "utterance_id": handle.utterance_id})
        if isinstance(text, str):
            self.push(handle, text, end=True)
        else:
            handle.feeder = self._loop.create_task(self._feed(handle, text))
        self._pump()
        return handle

    def _check_engine_room(self) -> None:
        """Refuse at the request, not with a later error event, an utterance that would open in an
        engine at its open-utterance limit. One queued behind this call's own opens in the slot its
        predecessor frees; cancelled utterances stop counting at once (`Engine.open_count`)."""
        if self._active is not None or self._queue:
            return
        open_count, limit = self.engine.open_count, self.engine.max_utterances
        if open_count >= limit:
            raise EngineBusyError(
                f"the engine has {open_count} open utterances (limits.max_utterances = {limit}); retry soon"
            )

    async def _feed(self, handle: SpeechHandle, deltas: AsyncIterable[str]) -> None:
        """Pull deltas into the utterance; a stream that brings no text (silent, or only empty or blank
        deltas) for `text_idle_timeout_s` fails it, so an input that never ends cannot hold the call's
        queue forever."""
        stream = aiter(deltas)
        deadline_s = self._loop.time() + self.text_idle_timeout_s
        try:
            while not handle.finished:
                try:
                    async with asyncio.timeout_at(deadline_s):
                        delta = await anext(stream)
                except StopAsyncIteration:
                    self.end_input(handle)
                    return
                if isinstance(delta, str) and delta.strip():
                    deadline_s = self._loop.time() + self.text_idle_timeout_s
                self.push(handle, delta)
        except TimeoutError:
            message = f"no text for {self.text_idle_timeout_s:g} s (limits.text_idle_timeout_s)"
            self.fail(handle, "text_idle_timeout", message)
        except VoiceRTCError as exc:
            self.fail(handle, exc.code, str(exc))
        except Exception as exc:  # noqa: BLE001 - a broken text stream fails its utterance only
            self.fail(handle, "bad_input", f"text stream failed: {type(exc).__name__}: {exc}")
        finally:
            await _close_stream(stream)

    def push(self, handle: SpeechHandle, delta: str, end: bool = False) -> None:
        """Append a delta; `end=True`: it is the last (a whole text goes to the engine as one command)."""
        if handle.finished or handle.input_ended:
            return
        if not isinstance(delta, str):
            raise InputError(f"text delta must be a string, got {type(delta).__name__}")
        check_text(delta, "text delta")
        handle.text_chars += len(delta)
        if handle.text_chars > self.max_text_chars:
            self.fail(handle, "text_too_long", f"text too long: more than {self.max_text_chars} characters")
            return
        handle.input_ended = end
        if handle is self._active:
            self.engine.push_text(handle.utterance_id, delta, end)
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
                if handle.options:  # only then: engines without options keep the 4-argument call
                    self.engine.open_utterance(
                        handle.voice, self.sink, self._on_engine_event, handle.utterance_id, handle.options
                    )
                else:
                    self.engine.open_utterance(
                        handle.voice, self.sink, self._on_engine_event, handle.utterance_id
                    )
            except VoiceRTCError as exc:
                self.fail(handle, exc.code, str(exc))
                continue
            self._active = handle
            handle.state = "synthesizing"
            handle.active_s = self._loop.time()
            if handle.pending_text:  # what came while queued, as one text (whole if its input ended)
                text = "".join(handle.pending_text)
                self.engine.push_text(handle.utterance_id, text, handle.input_ended)
            elif handle.input_ended:
                self.engine.end_input(handle.utterance_id)
            handle.pending_text.clear()

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
            if self.on_synthesized is not None:
                self.on_synthesized(event.metrics)
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
            # Every cancel this queue asks for finishes the handle first, so an unfinished one here
            # was cancelled by the engine itself: it is stopping. The next opens fail the same way.
            self.fail(handle, "engine_stopped", "the engine stopped before this utterance finished")

    # --- terminal events --------------------------------------------------------------------------

    def get(self, utterance_id: str) -> SpeechHandle | None:
        return self._by_id.get(utterance_id)

    def playout_started(self, utterance_id: str) -> ClientEvent | None:
        """The track sent the utterance's first frame: `speech.started` with its time to first audio.

        TTFA counts from when the utterance could first be heard: it was opened in the engine and
        the utterance before it had finished playing. Waiting behind earlier speech is not latency.
        """
        handle = self._by_id.get(utterance_id)
        if handle is None or handle.started:
            return None  # already terminal (a failed utterance's partial audio) or reported
        handle.started = True
        since_s = max(handle.active_s or handle.requested_s, self._playout_idle_s)
        ttfa_ms = 1000.0 * max(0.0, self._loop.time() - since_s)
        event = {"type": "speech.started", "utterance_id": utterance_id, "ttfa_ms": round(ttfa_ms, 1)}
        self.emit(event)
        return event

    def playout_done(self, utterance_id: str, played_ms: float) -> None:
        """The utterance's end mark played. One that never started had no audio (punctuation only):
        it ends with `speech.done` and no `speech.started`, so it adds no TTFA sample."""
        self._playout_idle_s = self._loop.time()
        handle = self._by_id.get(utterance_id)
        if handle is None:
            return
        self._finish(
            handle, {"type": "speech.done", "utterance_id": utterance_id, "played_ms": round(played_ms, 1)}
        )
        self._release_active(handle)  # its end mark was played, so the engine is done with it

    def fail(self, handle: SpeechHandle, code: str, message: str) -> None:
        if handle.finished:
            return
        logger.info("call %s utterance %s failed: %s: %s", self.call_id, handle.utterance_id, code, message)
        self.engine.cancel(handle.utterance_id)
        self._finish(
            handle, {"type": "error", "utterance_id": handle.utterance_id, "code": code, "message": message}
        )
        self._release_active(handle)

    def interrupt_all(
        self, playing_id: str | None, played_ms: float, heard_text: str = "", barge_in: str | None = None
    ) -> tuple[str | None, float]:
        """Cancel every unfinished utterance; the one playing reports `played_ms` and `heard_text`
        (the text of its chunks that had started playing), the others 0 and "". `barge_in` ("speech"
        or "words") marks an interrupt the caller's voice caused.

        Returns the utterance the interrupt is about: the one playing, else the oldest unfinished one.
        """
        victims = [h for h in self._by_id.values() if not h.finished]
        self._queue.clear()
        active, self._active = self._active, None
        if active is not None:
            self.engine.cancel(active.utterance_id)
        about = playing_id if playing_id in self._by_id else (victims[0].utterance_id if victims else None)
        for handle in victims:
            playing = handle.utterance_id == playing_id
            event: ClientEvent = {
                "type": "speech.interrupted",
                "utterance_id": handle.utterance_id,
                "played_ms": round(played_ms if playing else 0.0, 1),
                "heard_text": heard_text if playing else "",
            }
            if barge_in:
                event["barge_in"] = barge_in
            self._finish(handle, event)
        return about, (played_ms if about == playing_id else 0.0)

    def cancel_queued(self) -> list[str]:
        """Cancel the utterances still waiting for their turn (not opened in the engine, so none of
        their audio is in the ring): each reports `speech.interrupted` with nothing played. The one
        open in the engine and the one playing are left alone. Returns the cancelled ids."""
        waiting = [h for h in self._queue if not h.finished]
        self._queue.clear()
        for handle in waiting:
            event: ClientEvent = {
                "type": "speech.interrupted",
                "utterance_id": handle.utterance_id,
                "played_ms": 0.0,
                "heard_text": "",
            }
            self._finish(handle, event)
        return [h.utterance_id for h in waiting]

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
                    {
                        "type": "speech.interrupted",
                        "utterance_id": handle.utterance_id,
                        "played_ms": 0.0,
                        "heard_text": "",
                    }
                )
        self._by_id.clear()
        self._queue.clear()
        self._active = None

    @property
    def pending(self) -> int:
        return len(self._by_id)

    def first_pending(self) -> str | None:
        """The oldest unfinished utterance (playing, synthesizing or queued), or None."""
        return next(iter(self._by_id), None)


async def _close_stream(stream: AsyncIterator[str]) -> None:
    """Close an async generator we stopped reading (frees what it holds, e.g. a request body)."""
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except (RuntimeError, asyncio.CancelledError):
        pass  # still running elsewhere, or torn down with the loop
    except Exception:  # noqa: BLE001 - the stream's own cleanup failed: nothing left to do
        logger.debug("text stream close failed", exc_info=True)
