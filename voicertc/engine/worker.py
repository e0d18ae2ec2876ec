"""EngineWorker: the one thread that owns a backend and every utterance's state.

Runs on its own thread. Callers (any thread) only enqueue typed commands. The thread blocks on its
queue when nothing is runnable — with a timeout only when a backend names a time it becomes ready
(`Backend.wake_at`) — so it never polls. A failure inside one utterance becomes that utterance's
`Failed` event; the others keep going.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np

from voicertc.engine.backend import Backend, SynthStep
from voicertc.engine.protocol import (
    AudioSink,
    Cancel,
    Cancelled,
    Command,
    Done,
    EndInput,
    EngineEvent,
    EventCallback,
    Failed,
    FirstAudio,
    OpenUtterance,
    PushText,
    Stop,
    Wake,
)
from voicertc.engine.scheduler import is_runnable, pick_next, sink_heads
from voicertc.engine.utterance import Utterance
from voicertc.errors import InputError, UnknownVoiceError, VoiceRTCError

logger = logging.getLogger(__name__)

PIECE_MS = 100  # audio is written to sinks in pieces of at most this, so backpressure is fine-grained


class EngineWorker:
    """Implements `voicertc.engine.protocol.Engine` on top of one `Backend`."""

    def __init__(
        self,
        backend: Backend,
        *,
        default_voice: str = "",
        max_text_chars: int = 20_000,
        max_utterances: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.default_voice = default_voice
        self.max_text_chars = max_text_chars
        self.max_utterances = max_utterances
        self.clock = clock
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._utterances: dict[str, Utterance] = {}  # worker thread only
        self._open_count = 0
        self._count_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.stats = {"utterances": 0, "done": 0, "cancelled": 0, "failed": 0}

    # --- thread-safe API -------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"voicertc-{self.backend.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is None:
            return
        self._queue.put(Stop())
        self._thread.join(timeout_s)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def voices(self) -> list[str]:
        return self.backend.voices()

    def resolve_voice(self, voice: str | None) -> str:
        """The voice id to use for `voice` (None/'' = default); UnknownVoiceError names a bad one."""
        voices = self.backend.voices()
        if not voice:
            voice = self.default_voice or (voices[0] if voices else "")
        if voice not in voices:
            raise UnknownVoiceError(f"unknown voice {voice!r}; available: {', '.join(voices) or 'none'}")
        return voice

    def open_utterance(
        self, voice: str | None, sink: AudioSink, on_event: EventCallback, utterance_id: str | None = None
    ) -> str:
        resolved = self.resolve_voice(voice)
        with self._count_lock:
            if self._open_count >= self.max_utterances:
                raise InputError(f"too many open utterances (limit {self.max_utterances})")
            self._open_count += 1
        uid = utterance_id or uuid.uuid4().hex[:12]
        self._queue.put(OpenUtterance(uid, resolved, sink, on_event, sink.generation))
        return uid

    def push_text(self, utterance_id: str, text: str) -> None:
        self._queue.put(PushText(utterance_id, text))

    def end_input(self, utterance_id: str) -> None:
        self._queue.put(EndInput(utterance_id))

    def cancel(self, utterance_id: str) -> None:
        self._queue.put(Cancel(utterance_id))

    def wake(self) -> None:
        self._queue.put(Wake())

    def say(self, voice: str | None, sink: AudioSink, on_event: EventCallback, text: str) -> str:
        uid = self.open_utterance(voice, sink, on_event)
        self.push_text(uid, text)
        self.end_input(uid)
        return uid

    # --- the worker thread -----------------------------------------------------------------------

    def _run(self) -> None:
        logger.info("engine %s started", self.backend.name)
        running = True
        try:
            while running:
                heads = self._runnable_heads()
                if heads:
                    running = self._drain(block=False)
                    if running:
                        self._step(pick_next(heads))
                else:
                    running = self._drain(block=True, timeout_s=self._idle_timeout_s())
        except Exception:
            logger.exception("engine %s worker crashed", self.backend.name)
        finally:
            self._teardown()

    def _runnable_heads(self) -> list[Utterance]:
        now_s, runnable = self.clock(), []
        for utt in sink_heads(list(self._utterances.values())):
            try:
                if is_runnable(utt, self.backend, now_s):
                    runnable.append(utt)
            except Exception as exc:  # noqa: BLE001 - a broken sink or backend state fails only its utterance
                self._fail(utt, exc)
        return runnable

    def _idle_timeout_s(self) -> float | None:
        wakes = [w for u in self._utterances.values() if (w := self.backend.wake_at(u)) is not None]
        return max(0.0, min(wakes) - self.clock()) if wakes else None

    def _drain(self, block: bool, timeout_s: float | None = None) -> bool:
        """Apply queued commands; False once Stop arrives."""
        try:
            command = self._queue.get(block=block, timeout=timeout_s if block else None)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, Stop):
                return False
            self._apply(command)
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: Command) -> None:
        if isinstance(command, OpenUtterance):
            self._open(command)
            return
        if isinstance(command, Wake):
            return
        utt = self._utterances.get(command.utterance_id)
        if utt is None:
            return  # already finished (e.g. cancelled by an interrupt that cleared its sink)
        if isinstance(command, PushText):
            self._push_text(utt, command.text)
        elif isinstance(command, EndInput):
            utt.input_ended = True
            if utt.first_text_s is None:
                self._fail(utt, InputError("empty text: nothing to speak"))
        elif isinstance(command, Cancel):
            self._finish(utt, Cancelled(utt.utterance_id))

    def _open(self, command: OpenUtterance) -> None:
        utt = Utterance(
            utterance_id=command.utterance_id,
            voice=command.voice,
            sink=command.sink,
            on_event=command.on_event,
            generation=command.generation,
            opened_s=self.clock(),
        )
        self._utterances[utt.utterance_id] = utt
        self.stats["utterances"] += 1
        command.sink.set_space_listener(self.wake)
        logger.debug("utterance %s opened on voice %s", utt.utterance_id, utt.voice)
        try:
            self.backend.begin(utt)
        except Exception as exc:  # noqa: BLE001 - reported as the utterance's event
            self._fail(utt, exc)

    def _push_text(self, utt: Utterance, text: str) -> None:
        if utt.input_ended:
            return
        utt.text_chars_total += len(text)
        if utt.text_chars_total > self.max_text_chars:
            self._fail(utt, InputError(f"text too long: more than {self.max_text_chars} characters"))
            return
        if utt.first_text_s is None and text.strip():
            utt.first_text_s = self.clock()
        utt.text += text
        utt.metrics.setdefault("text_chars", 0.0)
        utt.metrics["text_chars"] += len(text)

    def _step(self, utt: Utterance) -> None:
        utt.steps += 1
        try:
            if not utt.pending_pcm and not utt.synthesis_done:
                started = self.clock()
                result = self.backend.step(utt, started)
                utt.add_metric("synth_s", self.clock() - started)
                self._accept(utt, result)
            self._write_pending(utt)
            if utt.utterance_id in self._utterances and utt.synthesis_done and not utt.pending_pcm:
                self._complete(utt)
        except Exception as exc:  # noqa: BLE001 - isolated per utterance
            self._fail(utt, exc)

    def _accept(self, utt: Utterance, result: SynthStep) -> None:
        if result.pcm:
            utt.sample_rate_hz = result.sample_rate_hz
            piece = max(1, result.sample_rate_hz * PIECE_MS // 1000)
            for pcm in result.pcm:
                for start in range(0, len(pcm), piece):
                    utt.pending_pcm.append((pcm[start : start + piece], result.sample_rate_hz))
            utt.chunks += 1
        if result.done:
            utt.synthesis_done = True

    def _write_pending(self, utt: Utterance) -> None:
        while utt.pending_pcm and utt.sink.has_room():
            pcm, rate = utt.pending_pcm.popleft()
            if not utt.sink.write(pcm, rate, utt.utterance_id, utt.generation):
                self._finish(utt, Cancelled(utt.utterance_id))  # the sink was cleared (interrupt)
                return
            utt.audio_samples += len(pcm)
            if utt.first_audio_s is None:
                utt.first_audio_s = self.clock()
                ttfa_s = utt.first_audio_s - (utt.first_text_s or utt.opened_s)
                utt.metrics["ttfa_s"] = ttfa_s
                self._emit(utt, FirstAudio(utt.utterance_id, ttfa_ms=1000.0 * ttfa_s))

    def _complete(self, utt: Utterance) -> None:
        utt.sink.end_utterance(utt.utterance_id, utt.generation)
        synth_s = utt.metrics.get("synth_s", 0.0)
        if utt.audio_ms:
            utt.metrics["rtf"] = synth_s / (utt.audio_ms / 1000.0)
        logger.info(
            "utterance %s done: ttfa_ms=%.0f audio_ms=%.0f rtf=%.3f chunks=%d",
            utt.utterance_id,
            1000.0 * utt.metrics.get("ttfa_s", 0.0),
            utt.audio_ms,
            utt.metrics.get("rtf", 0.0),
            utt.chunks,
        )
        self._finish(utt, Done(utt.utterance_id, audio_ms=utt.audio_ms, metrics=dict(utt.metrics)))

    def _fail(self, utt: Utterance, exc: BaseException) -> None:
        if isinstance(exc, VoiceRTCError):
            code, message = exc.code, str(exc)
            logger.warning("utterance %s failed: %s", utt.utterance_id, message)
        else:
            code, message = "synthesis_error", f"{type(exc).__name__}: {exc}"
            logger.error("utterance %s failed", utt.utterance_id, exc_info=exc)
        self._finish(utt, Failed(utt.utterance_id, code, message))

    def _finish(self, utt: Utterance, event: EngineEvent) -> None:
        """Remove `utt`, free its backend state, and send its one terminal event."""
        if self._utterances.pop(utt.utterance_id, None) is None:
            return
        utt.pending_pcm.clear()
        try:
            self.backend.release(utt)
        except Exception:
            logger.exception("utterance %s: backend release failed", utt.utterance_id)
        with self._count_lock:
            self._open_count -= 1
        self.stats[{Done: "done", Cancelled: "cancelled", Failed: "failed"}[type(event)]] += 1
        self._emit(utt, event)

    def _emit(self, utt: Utterance, event: EngineEvent) -> None:
        try:
            utt.on_event(event)
        except Exception:
            logger.exception("utterance %s: event callback failed", utt.utterance_id)

    def _teardown(self) -> None:
        for utt in list(self._utterances.values()):
            self._finish(utt, Cancelled(utt.utterance_id))
        try:
            self.backend.close()
        except Exception:
            logger.exception("engine %s: backend close failed", self.backend.name)
        logger.info("engine %s stopped", self.backend.name)


def as_float32(pcm: np.ndarray) -> np.ndarray:
    """PCM as contiguous float32 (int16 input is scaled to [-1, 1])."""
    if pcm.dtype == np.int16:
        return (pcm.astype(np.float32) / 32768.0).copy()
    return np.ascontiguousarray(pcm, dtype=np.float32)
