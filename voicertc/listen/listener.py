"""One call's ears: the remote microphone track -> 16 kHz PCM, VAD events, transcripts, barge-in.

Threads: aiortc's decoder thread decodes the caller's microphone and, routed there by the call
(`webrtc.mic_decode`), does the listening work on each frame at once (`ListenThread.process_frame`):
resampling (soxr), Silero VAD and the state machine, speech segments for the shared Whisper threads.
Frames that still arrive through the track (one aiortc's receiver did not create) are queued by a
reader task on the loop for the call's own listen thread; the reader also sees the track end.
Results hop back to the loop with `call_soon_threadsafe`, where `CallListener` fills the inbound
buffers, emits `user.*` events and asks the `BargeInPolicy`. The event loop never runs model code.

Timeline: media milliseconds since the first received frame, from the frames' pts (an RTP gap is
filled with silence so `at_ms` stays on the caller's clock; a frame that starts before what was
already heard is trimmed to the new part). A caller in DTX sends nothing during a silence: the
decoder thread hands its declared silence over as time passes (`fill_silence`, `webrtc.mic_decode`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame

from voicertc.config import ListenConfig
from voicertc.listen.bargein import BargeInDecision, BargeInPolicy
from voicertc.listen.inbound import LISTEN_RATE_HZ, InboundBuffer, InboundConverter
from voicertc.listen.models import VAD_WINDOW, SileroVad
from voicertc.listen.transcriber import Transcriber, TranscriptJob
from voicertc.listen.vad import SpeechStarted, SpeechStopped, VadStateMachine

logger = logging.getLogger(__name__)

FRAME_SAMPLES = 320  # 20 ms at 16 kHz: what readers get
PCM_BATCH_FRAMES = 10  # with nobody reading, frames hop to the loop's buffer 200 ms at a time
MAX_QUEUED_FRAMES = 100  # frames waiting for the listen thread (2 s at 20 ms); oldest dropped beyond
MAX_GAP_S = 1.0  # a pts jump larger than this restarts the timeline instead of filling silence
DTX_TICK_S = 0.01  # a caller's DTX silence is filled this often while a speech segment is open or read
DTX_IDLE_TICK_S = 0.1  # and this often otherwise
HISTORY_SLACK_MS = 300.0

Post = Callable[..., None]
EmitFn = Callable[[dict[str, Any]], None]


def _dbfs(samples: np.ndarray) -> float:
    """RMS level of float samples in [-1, 1] (a float32 dot product: exact enough for a threshold)."""
    return 10.0 * math.log10(float(np.dot(samples, samples)) / max(1, samples.size) + 1e-12)


def _ms(samples: int) -> float:
    return samples * 1000.0 / LISTEN_RATE_HZ


class ListenThread:
    """Per-call worker: convert, VAD, segment audio. Frames are processed one at a time (`_work`):
    queued ones on its own thread, routed ones (`process_frame`) on aiortc's decoder thread."""

    def __init__(
        self, call_id: str, config: ListenConfig, post: Post, transcriber: Transcriber | None
    ) -> None:
        self.call_id = call_id
        self.config = config
        self._post = post
        self._transcriber = transcriber
        self._partials = transcriber is not None and config.barge_in == "words"
        self._cond = threading.Condition()
        self._work = threading.Lock()  # one frame at a time, whichever thread hands it in
        self._stopped = False
        self._frames: deque[tuple[np.ndarray, int, int, int | None, int] | None] = deque()
        self.dropped_frames = 0  # frames the thread could not keep up with
        self.frames_received = 0  # decoded frames handed to the thread
        self._converter = InboundConverter()
        self._vad = SileroVad()
        self._machine = VadStateMachine(config.threshold, config.min_speech_ms, config.min_silence_ms)
        self._next_pts: int | None = None
        self._channels = 1  # of the last frame heard (DTX silence is filled in its layout)
        self._pos = 0  # 16 kHz samples on the timeline so far
        self._window = np.zeros(0, dtype=np.int16)
        self._out = np.zeros(0, dtype=np.int16)  # converted samples not yet posted as a whole frame
        self._pcm_unposted: list[np.ndarray] = []  # whole frames waiting to hop to the loop
        self.live_readers = 0  # set on the loop: readers of the PCM now (frames then hop one by one)
        self._vad_pos = 0  # timeline sample where `_window` starts
        self._history: deque[tuple[int, np.ndarray]] = deque()  # (start sample, float32 pcm)
        self._segment = 0
        self._seg_start: int | None = None  # timeline sample the current segment's audio starts
        self._seg_onset_ms = 0.0
        self._last_partial = 0
        self._thread = threading.Thread(target=self._run, name=f"voicertc-listen-{call_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put_frame(self, frame: AudioFrame) -> None:
        """A decoded microphone frame, queued for this thread (from the loop's reader)."""
        self.put(frame.to_ndarray(), frame.sample_rate, len(frame.layout.channels), frame.pts, frame.samples)

    def process_frame(self, frame: AudioFrame) -> None:
        """A decoded microphone frame, processed now on the calling thread (aiortc's decoder thread,
        which decodes one frame per 20 ms: no queue, no wake-up of this thread per frame)."""
        if self._stopped:
            return
        self.frames_received += 1
        pcm = frame.to_ndarray()
        try:
            with self._work:
                self.process(pcm, frame.sample_rate, len(frame.layout.channels), frame.pts, frame.samples)
        except Exception:
            logger.exception("call %s: listening failed on a frame", self.call_id)

    def fill_silence(self, until_pts: int, sample_rate_hz: int) -> None:
        """The caller declared its audio silent (DTX) up to `until_pts`: hear zeros up to there
        (decoder thread; nothing when the timeline is already further or has no pts yet)."""
        if self._stopped:
            return
        with self._work:
            start = self._next_pts
            if start is None or until_pts <= start:
                return
            samples = min(until_pts - start, int(MAX_GAP_S * sample_rate_hz))
            pcm = np.zeros(samples * self._channels, dtype=np.int16)
            self.process(pcm, sample_rate_hz, self._channels, start, samples)

    def silence_tick_s(self) -> float:
        """How often DTX silence should be filled now: finely while a segment may be ending or a reader
        takes the PCM live."""
        return DTX_TICK_S if (not self._machine.idle or self.live_readers) else DTX_IDLE_TICK_S

    def put(self, pcm: np.ndarray, rate: int, channels: int, pts: int | None, samples: int) -> None:
        with self._cond:
            self.frames_received += 1
            if len(self._frames) >= MAX_QUEUED_FRAMES:
                self._frames.popleft()
                self.dropped_frames += 1
            self._frames.append((pcm, rate, channels, pts, samples))
            self._cond.notify()

    def stop(self) -> None:
        self._stopped = True
        with self._cond:
            self._frames.clear()
            self._frames.append(None)
            self._cond.notify()

    def join(self, timeout_s: float = 2.0) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._frames:
                    self._cond.wait()
                item = self._frames.popleft()
            if item is None:
                return
            try:
                with self._work:
                    self.process(*item)
            except Exception:
                logger.exception("call %s: listening failed on a frame", self.call_id)

    # --- the work (also callable directly, for tests and the bench) ---------------------------------

    def process(self, pcm: np.ndarray, rate: int, channels: int, pts: int | None, samples: int) -> None:
        self._channels = channels
        gap = self._gap_samples(pts, samples, rate)
        if gap > 0:
            pcm = np.concatenate((np.zeros(gap * channels, dtype=pcm.dtype), pcm.reshape(-1)))
        elif gap < 0:  # the frame starts before what was heard (after a DTX fill): its new part only
            pcm = pcm.reshape(-1)[-gap * channels :]
            if pcm.size == 0:
                return
        out = self._converter.convert(pcm, rate, channels)
        if out.size == 0:
            return
        start = self._pos
        self._pos += out.size
        self._out = np.concatenate((self._out, out)) if self._out.size else out
        while self._out.size >= FRAME_SAMPLES:
            self._pcm_unposted.append(self._out[:FRAME_SAMPLES].copy())
            self._out = self._out[FRAME_SAMPLES:]
        if self._pcm_unposted and (self.live_readers or len(self._pcm_unposted) >= PCM_BATCH_FRAMES):
            self._post("pcm", self._pcm_unposted)
            self._pcm_unposted = []
        if self._transcriber is not None:  # segments' audio is kept for Whisper only
            self._history.append((start, out.astype(np.float32) * (1.0 / 32768.0)))
        self._run_vad(out)
        self._maybe_partial()
        self._prune()

    def _gap_samples(self, pts: int | None, samples: int, rate: int) -> int:
        """Samples of silence to hear before this frame (> 0), or of its head already heard (< 0: a
        frame that arrived after its time was filled as DTX silence)."""
        if pts is None:
            return 0
        expected = self._next_pts
        if expected is not None and -MAX_GAP_S * rate <= pts - expected < 0:
            self._next_pts = max(expected, pts + samples)
            return max(pts - expected, -samples)
        self._next_pts = pts + samples
        if expected is None:
            return 0
        gap = pts - expected
        return gap if 0 < gap <= MAX_GAP_S * rate else 0

    def _run_vad(self, out: np.ndarray) -> None:
        self._window = np.concatenate((self._window, out)) if self._window.size else out
        while self._window.size >= VAD_WINDOW:
            window, self._window = self._window[:VAD_WINDOW], self._window[VAD_WINDOW:]
            start_ms, end_ms = _ms(self._vad_pos), _ms(self._vad_pos + VAD_WINDOW)
            self._vad_pos += VAD_WINDOW
            samples = window.astype(np.float32) * (1.0 / 32768.0)
            machine = self._machine
            if _dbfs(samples) >= self.config.min_level_dbfs:
                prob = self._vad(samples)
            elif machine.idle:
                # too quiet to start speech while nothing is going on: whatever Silero said, the capped
                # score below would leave the machine as it is, so the model is not run at all
                self._vad.skip(samples)
                prob = 0.0
            else:
                # too quiet to start speech (echo residue, hiss): capped between the two thresholds,
                # it can neither open a segment nor split one at a quiet consonant
                prob = min(self._vad(samples), (machine.threshold + machine.low_threshold) / 2)
            event = machine.update(prob, start_ms, end_ms)
            if isinstance(event, SpeechStarted):
                self._on_started(event)
            elif isinstance(event, SpeechStopped):
                self._on_stopped(event)

    def _on_started(self, event: SpeechStarted) -> None:
        self._segment += 1
        pad = int(self.config.speech_pad_ms * LISTEN_RATE_HZ / 1000)
        self._seg_start = max(0, int(event.at_ms * LISTEN_RATE_HZ / 1000) - pad)
        self._seg_onset_ms = event.at_ms
        self._last_partial = -(10**9)
        self._post("started", self._segment, event)
        self._maybe_partial()

    def _on_stopped(self, event: SpeechStopped) -> None:
        self._post("stopped", self._segment, event)
        if self._seg_start is not None and self._transcriber is not None:
            pad = int(self.config.speech_pad_ms * LISTEN_RATE_HZ / 1000)
            end = min(self._pos, int(event.end_ms * LISTEN_RATE_HZ / 1000) + pad)
            self._submit(self._seg_start, end, True, event.at_ms, event.end_ms)
        self._seg_start = None

    def _maybe_partial(self) -> None:
        if self._seg_start is None or self._transcriber is None:
            return
        if self._pos - self._seg_start >= self.config.max_segment_s * LISTEN_RATE_HZ:
            # a very long segment: transcribe this piece now and go on with the next
            onset_ms = max(self._seg_onset_ms, _ms(self._seg_start))
            self._submit(self._seg_start, self._pos, True, onset_ms, _ms(self._pos))
            self._seg_start = self._pos
            return
        every = self.config.partial_every_ms * LISTEN_RATE_HZ / 1000
        if self._partials and self._pos - self._last_partial >= every:
            self._last_partial = self._pos
            self._submit(self._seg_start, self._pos, False, self._seg_onset_ms, _ms(self._pos))

    def _submit(self, start: int, end: int, final: bool, start_ms: float, end_ms: float) -> None:
        assert self._transcriber is not None
        pcm = self._audio(start, end)
        if pcm.size < LISTEN_RATE_HZ // 10:
            return
        segment = self._segment

        def on_text(text: str) -> None:
            self._post("text", segment, text, final, start_ms, end_ms)

        def on_dropped() -> None:
            self._post("text", segment, "", final, start_ms, end_ms, True)

        job = TranscriptJob((self.call_id, segment), pcm, final, on_text, on_dropped)
        self._transcriber.submit(job)

    def cancel_transcripts(self) -> None:
        """The call ended: Whisper drops this call's waiting segments and stops its running one."""
        if self._transcriber is not None:
            self._transcriber.cancel_call(self.call_id)

    def _audio(self, start: int, end: int) -> np.ndarray:
        pieces = [
            pcm[max(0, start - s) : max(0, end - s)]
            for s, pcm in self._history
            if s + pcm.size > start and s < end
        ]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)

    def _prune(self) -> None:
        keep_ms = self.config.min_speech_ms + self.config.speech_pad_ms + HISTORY_SLACK_MS
        keep_from = self._pos - int(keep_ms * LISTEN_RATE_HZ / 1000)
        if self._seg_start is not None:
            keep_from = min(keep_from, self._seg_start)
        while self._history and self._history[0][0] + self._history[0][1].size < keep_from:
            self._history.popleft()


class CallListener:
    """The loop side of one call's listening. Owned by the event loop.

    `buffer` holds 16 kHz PCM for `Call.listen()`; `tap()` gives each extra reader (the audio
    WebSocket) its own bounded buffer. Drops of every buffer are summed in `dropped_frames`.
    """

    def __init__(
        self,
        call_id: str,
        config: ListenConfig,
        emit: EmitFn,
        current_utterance: Callable[[], str | None],
        barge_in: Callable[[BargeInDecision], None],
        transcriber: Transcriber | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.call_id = call_id
        self.config = config
        self._emit = emit
        self._barge_in = barge_in
        self._loop = asyncio.get_running_loop()
        self.policy = BargeInPolicy(config.barge_in, config.backchannels, current_utterance, clock)
        self.buffer = InboundBuffer(config.inbound_buffer_ms)
        self._taps: list[InboundBuffer] = []
        self._tap_drops = 0
        self.thread = ListenThread(call_id, config, self._post, transcriber)
        self._reader: asyncio.Task[None] | None = None
        self.speech_segments = 0
        self.transcripts = 0
        self.transcripts_dropped = 0  # segments whose transcript Whisper's queue dropped
        self.closed = False

    # --- wiring -----------------------------------------------------------------------------------

    def start(self, track: MediaStreamTrack) -> None:
        """Start listening to `track`. Frames may also be handed to `thread.process_frame` from another
        thread (the call routes aiortc's decoded frames there); the reader queues what `recv()` yields."""
        self.thread.start()
        self._reader = self._loop.create_task(self._read(track), name=f"call-{self.call_id}-listen")

    @property
    def frames_received(self) -> int:
        return self.thread.frames_received

    async def _read(self, track: MediaStreamTrack) -> None:
        with contextlib.suppress(MediaStreamError):
            while not self.closed:
                frame = await track.recv()
                if isinstance(frame, AudioFrame):  # a microphone track yields audio frames only
                    self.thread.put_frame(frame)
        logger.info("call %s: microphone track ended", self.call_id)

    def _post(self, kind: str, *args: Any) -> None:
        """Listen thread -> loop."""
        try:
            self._loop.call_soon_threadsafe(self._deliver, kind, args)
        except RuntimeError:
            pass  # the loop is closed: the call is gone

    def _deliver(self, kind: str, args: tuple[Any, ...]) -> None:
        if self.closed:
            return
        if kind == "pcm":
            self._on_pcm(args[0])
        elif kind == "started":
            self._on_started(args[1])
        elif kind == "stopped":
            self._on_stopped(args[1])
        elif kind == "text":
            self._on_text(*args)

    # --- results on the loop ----------------------------------------------------------------------

    def _on_pcm(self, frames: list[np.ndarray]) -> None:
        for pcm in frames:
            self.buffer.push(pcm)
            for tap in self._taps:
                self._tap_drops += tap.push(pcm)

    async def frames(self) -> AsyncIterator[np.ndarray]:
        """The call's inbound buffer as it fills (one reader at a time), until the listener closes."""
        self.thread.live_readers += 1
        try:
            while (frame := await self.buffer.get()) is not None:
                yield frame
        finally:
            self.thread.live_readers -= 1

    def _on_started(self, event: SpeechStarted) -> None:
        self.speech_segments += 1
        logger.info("call %s: caller speech started at %.0f ms", self.call_id, event.at_ms)
        self._emit({"type": "user.speech.started", "at_ms": round(event.at_ms, 1)})
        decision = self.policy.speech_started(event.at_ms)
        if decision is not None:
            self._barge_in(decision)

    def _on_stopped(self, event: SpeechStopped) -> None:
        self.policy.speech_stopped()
        self._emit(
            {
                "type": "user.speech.stopped",
                "at_ms": round(event.end_ms, 1),
                "duration_ms": round(event.duration_ms, 1),
            }
        )

    def _on_text(
        self, segment: int, text: str, final: bool, start_ms: float, end_ms: float, dropped: bool = False
    ) -> None:
        if dropped:
            self.transcripts_dropped += 1
            self._emit(
                {
                    "type": "user.transcript",
                    "text": "",
                    "start_ms": round(start_ms, 1),
                    "end_ms": round(end_ms, 1),
                    "dropped": True,
                }
            )
            return
        if final and text:
            self.transcripts += 1
            self._emit(
                {
                    "type": "user.transcript",
                    "text": text,
                    "start_ms": round(start_ms, 1),
                    "end_ms": round(end_ms, 1),
                }
            )
        decision = self.policy.transcript(segment, text, final)
        if decision is not None:
            self._barge_in(decision)

    # --- readers ------------------------------------------------------------------------------------

    def tap(self, max_ms: float | None = None) -> InboundBuffer:
        buffer = InboundBuffer(max_ms or self.config.inbound_buffer_ms)
        if self.closed:
            buffer.close()
        else:
            self._taps.append(buffer)
            self.thread.live_readers += 1
        return buffer

    def untap(self, buffer: InboundBuffer) -> None:
        if buffer in self._taps:
            self._taps.remove(buffer)
            self.thread.live_readers -= 1
        buffer.close()

    @property
    def dropped_frames(self) -> int:
        """16 kHz frames dropped because a reader (or the listen thread) fell behind."""
        return self.buffer.dropped_frames + self._tap_drops + self.thread.dropped_frames

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        self.thread.stop()
        self.thread.cancel_transcripts()
        self.buffer.close()
        for tap in self._taps:
            tap.close()
        self._taps.clear()
        await asyncio.get_running_loop().run_in_executor(None, self.thread.join)
