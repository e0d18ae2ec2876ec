"""One utterance spoken into an async iterator of PCM16 bytes: the engine outlet of the OpenAI-style
speech endpoint, the TTS WebSocket and the in-process agent adapters (no WebRTC, no ring, no pacing).

Threads: `StreamSink.write` / `end_utterance` / `abort_utterance` run on the engine thread; everything
else (`SpeechStream`, `StreamSink.read`) on the event loop. The sink hands PCM over through a lock-held
deque and wakes the loop with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np

from voicertc.audio.resample import StreamingResampler
from voicertc.audio.sink import float_to_int16
from voicertc.audio.trim import leading_trim_samples
from voicertc.engine.protocol import Cancelled, Done, Engine, EngineEvent, Failed, FirstAudio, SpeakOptions
from voicertc.errors import EngineStoppedError
from voicertc.webrtc.speech import EngineBusyError

logger = logging.getLogger(__name__)

STREAM_RATE_HZ = 24_000  # what /v1/audio/speech and /v1/tts/stream send unless asked otherwise
MAX_BUFFER_MS = 10_000.0  # PCM the engine may run ahead of a slow reader before it waits (backpressure)
_END = b""  # the end mark in the sink's deque (never a real piece: empty pieces are not queued)


@dataclass(frozen=True)
class TextMark:
    """The engine's text for the audio that follows (SynthStep.text: a clause, a chunk, a segment)."""

    text: str
    audio_ms: float  # where that audio starts, from the utterance's first sample


class StreamSink:
    """`AudioSink` for one utterance whose reader is a coroutine (an HTTP body, a WebSocket).

    Engine thread: `write` resamples to `sample_rate_hz` and queues int16 LE bytes; `end_utterance`
    flushes the resampler and queues the end mark. Loop: `read()` takes everything queued. `clear()`
    (cancel) bumps the generation, so the engine's later writes are refused and it reports Cancelled.

    `queued_ms` is how far the audio written runs ahead of real time since its first piece, as if the
    reader played it: the scheduler then serves these utterances like WebRTC calls, not as always late.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sample_rate_hz: int = STREAM_RATE_HZ,
        *,
        max_buffer_ms: float = MAX_BUFFER_MS,
        trim_leading_ms: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sample_rate_hz = int(sample_rate_hz)
        self.trim_leading_ms = trim_leading_ms
        self._loop = loop
        self._clock = clock
        self._max_buffer_bytes = int(2 * self.sample_rate_hz * max_buffer_ms / 1000)
        self._lock = threading.Lock()
        self._pieces: deque[bytes | TextMark] = deque()  # under _lock
        self._buffered_bytes = 0  # under _lock
        self._generation = 0
        self._resampler: StreamingResampler | None = None  # engine thread only
        self._written_samples = 0  # engine thread only: samples queued at sample_rate_hz
        self._input_ms = 0.0  # engine thread only: audio written, at the engine's rate (marks)
        self._first_write_s: float | None = None
        self._space_listener: Callable[[], None] | None = None
        self._marks: list[TextMark] = []  # loop side: read and not yet taken
        self.arrived = asyncio.Event()  # set (on the loop) when pieces or the end mark arrive

    # --- AudioSink (engine thread) ----------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def queued_ms(self) -> float:
        if self._first_write_s is None:
            return 0.0
        ahead_s = self._written_samples / self.sample_rate_hz - (self._clock() - self._first_write_s)
        return max(0.0, 1000.0 * ahead_s)

    def has_room(self) -> bool:
        with self._lock:
            return self._buffered_bytes < self._max_buffer_bytes

    def set_space_listener(self, callback: Callable[[], None] | None) -> None:
        self._space_listener = callback

    def write(self, pcm: np.ndarray, sample_rate_hz: int, utterance_id: str, generation: int) -> bool:
        if generation != self._generation:
            return False
        if self._resampler is None:
            if self.trim_leading_ms > 0:
                pcm = pcm[leading_trim_samples(pcm, int(sample_rate_hz), self.trim_leading_ms) :]
            self._resampler = StreamingResampler(int(sample_rate_hz), self.sample_rate_hz)
            self._first_write_s = self._clock()
        elif self._resampler.in_rate_hz != int(sample_rate_hz):  # a new engine rate mid-utterance
            self._queue(self._resampler.flush())
            self._resampler = StreamingResampler(int(sample_rate_hz), self.sample_rate_hz)
        self._input_ms += 1000.0 * len(pcm) / sample_rate_hz
        self._queue(self._resampler.process(pcm))
        return True

    def mark_text(self, utterance_id: str, generation: int, text: str) -> None:
        """Engine thread: the audio written next speaks `text` (before that audio is written)."""
        if generation != self._generation or not text:
            return
        mark = TextMark(text, self._input_ms)  # input time: the resampler's delay does not move it
        with self._lock:
            self._pieces.append(mark)

    def end_utterance(self, utterance_id: str, generation: int) -> None:
        if generation != self._generation:
            return
        if self._resampler is not None:
            self._queue(self._resampler.flush())
        self._queue_end()

    def abort_utterance(self, utterance_id: str, generation: int) -> None:
        self._queue_end()

    def _queue(self, pcm: np.ndarray) -> None:
        if not pcm.size:
            return
        data = float_to_int16(pcm).astype("<i2").tobytes()
        self._written_samples += pcm.size
        with self._lock:
            self._pieces.append(data)
            self._buffered_bytes += len(data)
        self._notify()

    def _queue_end(self) -> None:
        with self._lock:
            self._pieces.append(_END)
        self._notify()

    def _notify(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self.arrived.set)
        except RuntimeError:
            pass  # the loop is closed: the reader is gone

    # --- the reader (event loop) ------------------------------------------------------------------

    def clear(self) -> None:
        """Drop what is queued and refuse the engine's later writes (a cancel)."""
        self._generation += 1
        with self._lock:
            self._pieces.clear()
            self._buffered_bytes = 0

    def read(self) -> tuple[bytes, bool]:
        """Everything queued now, joined, and whether the end mark came with it."""
        with self._lock:
            pieces = list(self._pieces)
            self._pieces.clear()
            was_full = self._buffered_bytes >= self._max_buffer_bytes
            self._buffered_bytes = 0
            self.arrived.clear()
        ended = bool(pieces) and pieces[-1] == _END
        listener = self._space_listener
        if was_full and listener is not None:
            listener()  # thread-safe: the engine's wake() only enqueues
        self._marks += [p for p in pieces if isinstance(p, TextMark)]
        return b"".join(p for p in pieces if isinstance(p, bytes)), ended

    def take_marks(self) -> list[TextMark]:
        """The text marks read so far and not yet taken (each comes before or inside the audio read)."""
        marks, self._marks = self._marks, []
        return marks


class SpeechStream:
    """One utterance of `engine`, its audio as PCM16 LE mono bytes at `sample_rate_hz`. Loop-owned.

    `open()` (raises `VoiceRTCError`: engine stopped or busy, unknown voice), `push(text)` any number
    of times, `end_input()`, then iterate `chunks()`; `cancel()` stops it at once (the iterator ends,
    the engine frees the utterance). `outcome` holds the terminal engine event once it arrived.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        voice: str | None = None,
        options: SpeakOptions | None = None,
        sample_rate_hz: int = STREAM_RATE_HZ,
        trim_leading_ms: float = 0.0,
        utterance_id: str | None = None,
    ) -> None:
        self.engine = engine
        self.voice = voice
        self.options = options if options else None
        self.utterance_id = utterance_id or uuid.uuid4().hex[:12]
        self._loop = asyncio.get_running_loop()
        self.sink = StreamSink(self._loop, sample_rate_hz, trim_leading_ms=trim_leading_ms)
        self.outcome: EngineEvent | None = None
        self.cancelled = False
        self.opened = False
        self.first_text_s: float | None = None  # loop time of the first non-empty text
        self.first_audio_s: float | None = None  # loop time the first PCM reached the reader
        self.audio_bytes = 0
        self.terminal = asyncio.Event()  # set when `outcome` arrives

    @property
    def sample_rate_hz(self) -> int:
        return self.sink.sample_rate_hz

    @property
    def ttfa_ms(self) -> float | None:
        """First text pushed -> first audio handed to the reader (loop time)."""
        if self.first_audio_s is None or self.first_text_s is None:
            return None
        return 1000.0 * (self.first_audio_s - self.first_text_s)

    @property
    def audio_ms(self) -> float:
        return 1000.0 * self.audio_bytes / (2 * self.sample_rate_hz)

    def open(self) -> str:
        check_engine_room(self.engine)
        if self.options:  # only then: engines without options keep the 4-argument call
            self.engine.open_utterance(self.voice, self.sink, self._on_event, self.utterance_id, self.options)
        else:
            self.engine.open_utterance(self.voice, self.sink, self._on_event, self.utterance_id)
        self.opened = True
        return self.utterance_id

    def push(self, text: str, end: bool = False) -> None:
        """Append text; `end=True`: it is the last (a whole text reaches the engine as one command)."""
        if self.cancelled or self.outcome is not None:
            return
        if self.first_text_s is None and text.strip():
            self.first_text_s = self._loop.time()
        self.engine.push_text(self.utterance_id, text, end)

    def end_input(self) -> None:
        if not self.cancelled and self.outcome is None:
            self.engine.end_input(self.utterance_id)

    def cancel(self) -> None:
        """Stop now: the engine drops the utterance, `chunks()` ends, nothing more is delivered."""
        if self.cancelled:
            return
        self.cancelled = True
        self.sink.clear()
        self.sink.arrived.set()
        if self.opened and self.outcome is None:
            self.engine.cancel(self.utterance_id)

    async def chunks(self) -> AsyncIterator[bytes]:
        """PCM as the engine makes it (each piece whatever was ready), until the utterance ends."""
        ended = False
        while not self.cancelled:
            data, ended = self.sink.read()
            if data:
                yield self._delivered(data)
            if ended:
                break
            if self.outcome is not None:  # ended without an end mark (never opened in the engine)
                data, ended = self.sink.read()
                if data and not self.cancelled:
                    yield self._delivered(data)
                break
            await self.sink.arrived.wait()
        if ended and self.outcome is None and not self.cancelled:
            await self.terminal.wait()  # the engine's Done/Failed follows its end mark

    def take_marks(self) -> list[TextMark]:
        """Text marks of the audio delivered so far, not yet taken (`TextMark.audio_ms` places each)."""
        return self.sink.take_marks()

    def _delivered(self, data: bytes) -> bytes:
        if self.first_audio_s is None:
            self.first_audio_s = self._loop.time()
        self.audio_bytes += len(data)
        return data

    @property
    def failure(self) -> Failed | None:
        return self.outcome if isinstance(self.outcome, Failed) else None

    # --- engine events (engine thread -> loop) ----------------------------------------------------

    def _on_event(self, event: EngineEvent) -> None:
        try:
            self._loop.call_soon_threadsafe(self._handle_event, event)
        except RuntimeError:
            pass  # the loop is closed

    def _handle_event(self, event: EngineEvent) -> None:
        if isinstance(event, FirstAudio):
            return
        if isinstance(event, Done | Failed | Cancelled) and self.outcome is None:
            self.outcome = event
            self.terminal.set()
            self.sink.arrived.set()
            if isinstance(event, Cancelled) and not self.cancelled:
                logger.info("utterance %s cancelled by the engine (stopping)", self.utterance_id)


def check_engine_room(engine: Engine) -> None:
    """Refuse at the request an utterance that would open in a stopped engine or one at its
    open-utterance limit (cancelled utterances stop counting at once)."""
    if not engine.running:
        raise EngineStoppedError("the engine is not running")
    open_count, limit = engine.open_count, engine.max_utterances
    if open_count >= limit:
        raise EngineBusyError(
            f"the engine has {open_count} open utterances (limits.max_utterances = {limit}); retry soon"
        )
