"""`SpeechTrack`: the aiortc audio track that plays a `PcmRing` out in real time. Runs on the event loop.

aiortc's sender calls `recv()` in a tight loop and never paces, so this track does (webrtc.md §5):
20 ms s16 frames at 48 kHz, one layout for the whole call, `pts` a contiguous sample counter with
`time_base = 1/48000` (it becomes the RTP timestamp), an absolute schedule on a monotonic clock
anchored at the first `recv()`, silence when the ring runs dry (never a stall), and no exception out
of `recv()` other than `MediaStreamError` (anything else stops aiortc's sender for good).
Barge-in flushes here, at the last buffer before the encoder: `interrupt()`.

Silence: once the sender's codec is known to be Opus (`send_silence_as`, set by the call after the
answer), a silent frame after `SILENT_FRAMES_ENCODED` silent ones is handed over as the encoder's own
silence packet (`webrtc.opus_send`): no frame built, no encoder thread hop, the same RTP bytes. With
DTX (`[webrtc] dtx`, `webrtc.dtx`), 200 ms of silence later the track hands over the 1-byte DTX packet
once per 400 ms and sleeps in between until the ring has samples again (the ring's data listener
wakes it from the engine thread): a silent call costs the loop no wake-up per frame. The skipped
frames keep their place on the schedule and in `pts`, so the RTP timestamps jump over the silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame, Packet

from voicertc.audio import PcmRing, Span, fade_out
from voicertc.webrtc.dtx import DtxSchedule, FrameAction, dtx_packet
from voicertc.webrtc.opus_send import SAMPLES_PER_FRAME, silence_packet

logger = logging.getLogger(__name__)

SAMPLE_RATE_HZ = 48000
TIME_BASE = Fraction(1, SAMPLE_RATE_HZ)
GAP_S = 0.1  # a pause between frames longer than this counts in `gaps_over_100ms`
SILENT_FRAMES_ENCODED = 5  # silent frames encoded before its silence packet stands in (it settles in 3)


@dataclass(frozen=True)
class PlayoutEvent:
    """Playback progress of one utterance, as sent to the peer (not as synthesized).

    kind: "started" (first frame holding its samples was handed to the sender), "done" (its end mark
    was passed), "interrupted" (flushed by `interrupt()`; no "done" follows).
    """

    kind: Literal["started", "done", "interrupted"]
    utterance_id: str
    played_ms: float = 0.0
    underrun_frames: int = 0


@dataclass(frozen=True)
class InterruptResult:
    """The utterance that was playing when `interrupt()` ran (None if idle) and how much of it was sent."""

    utterance_id: str | None
    played_ms: float


@dataclass
class TrackStats:
    """Playout as the peer gets it. Honest whatever the cause (engine, event loop, CPU): a frame due
    while an utterance played and never sent (skipped when the schedule re-anchored) is an underrun
    frame like a silence frame; a frame sent more than one frame after its due time is late; a pause
    of over 100 ms between two frames is a gap (the peer's jitter buffer hears it)."""

    frames_sent: int = 0
    dtx_frames: int = 0  # silent frames not sent (DTX): their time passed with no packet
    underrun_frames: int = 0  # silence frames sent, or due frames skipped, while an utterance played
    late_frames: int = 0  # frames sent more than one frame after their due time
    gaps_over_100ms: int = 0  # pauses of more than 100 ms between two consecutive frames
    interrupts: int = 0
    reanchors: int = 0  # times the schedule fell more than max_lag_ms behind and was restarted


@dataclass
class _Playback:
    samples: int = 0
    underrun_frames: int = 0


PlayoutCallback = Callable[[PlayoutEvent], None]
Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[Any]]
WaitForData = Callable[[asyncio.Event, float], Awaitable[Any]]


async def wait_for_data(event: asyncio.Event, timeout_s: float) -> None:
    """Until `event` is set or `timeout_s` passed, whichever comes first."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)


class SpeechTrack(MediaStreamTrack):
    """Sends the ring's PCM as paced 48 kHz s16 frames; silence when there is none.

    Owner: the event loop (recv, interrupt, callbacks). State: `_samples_sent` (= next pts), the
    schedule anchor, the pending faded tail of an interrupted utterance, per-utterance playback.
    """

    kind = "audio"

    def __init__(
        self,
        ring: PcmRing,
        *,
        frame_ms: int = 20,
        stereo: bool = True,
        interrupt_fade_ms: int = 10,
        max_lag_ms: float = 200.0,
        on_playout: PlayoutCallback | None = None,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        wait_data: WaitForData = wait_for_data,
    ) -> None:
        super().__init__()
        if ring.sample_rate_hz != SAMPLE_RATE_HZ:
            raise ValueError(f"SpeechTrack needs a {SAMPLE_RATE_HZ} Hz ring, got {ring.sample_rate_hz} Hz")
        if frame_ms not in (10, 20):
            raise ValueError(f"SpeechTrack frame_ms must be 10 or 20 (aiortc), got {frame_ms}")
        self.ring = ring
        self.frame_samples = SAMPLE_RATE_HZ * frame_ms // 1000
        self.stereo = stereo
        self.fade_samples = SAMPLE_RATE_HZ * interrupt_fade_ms // 1000
        self.on_playout = on_playout
        self.stats = TrackStats()
        self._frame_s = frame_ms / 1000.0
        self._max_lag_s = max_lag_ms / 1000.0
        self._clock = clock
        self._sleep = sleep
        self._wait_data = wait_data
        self._samples_sent = 0  # the next frame's pts
        self._frame_index = 0  # frames sent or skipped (DTX): the next frame's place on the schedule
        self._anchor_t: float | None = None
        self._anchor_frame = 0
        self._last_frame_t: float | None = None
        self._fade_tail = np.zeros(0, dtype=np.int16)
        self._playing: str | None = None
        self._playback: dict[str, _Playback] = {}
        self._silence_payload: bytes | None = None
        self._silent_frames = 0  # silent frames in a row, the current one included
        self.silence_packets = 0  # silent frames handed over as the encoder's silence packet
        self._dtx: DtxSchedule | None = None
        self._dtx_payload = b""
        self._data = asyncio.Event()  # set from the engine thread when the ring gets samples

    def send_silence_as(self, payload: bytes | None, dtx: bool = False) -> None:
        """The sender encodes with Opus and settles on `payload` for digital silence (None: encode every
        frame). Only for 20 ms stereo frames, the encoder's own format. `dtx`: and the track sends
        long silences as DTX (module docstring)."""
        ready = self.stereo and self.frame_samples == SAMPLES_PER_FRAME
        self._silence_payload = payload if ready else None
        self._dtx = DtxSchedule() if dtx and self._silence_payload else None
        self._dtx_payload = dtx_packet(self._silence_payload) if self._silence_payload and dtx else b""
        if self._dtx is not None:
            loop = asyncio.get_running_loop()

            def wake() -> None:  # engine thread: the ring got samples
                with contextlib.suppress(RuntimeError):  # the loop closed under a late write
                    loop.call_soon_threadsafe(self._data.set)

            self.ring.set_data_listener(wake)

    def stop(self) -> None:
        super().stop()
        self.ring.set_data_listener(None)
        self._data.set()  # a recv() asleep in DTX sees the end now

    @classmethod
    def from_config(cls, ring: PcmRing, config: Any, **kwargs: Any) -> SpeechTrack:
        """Build from a `voicertc.config.WebRTCConfig` (frame_ms, stereo, interrupt_fade_ms)."""
        return cls(
            ring,
            frame_ms=config.frame_ms,
            stereo=config.stereo,
            interrupt_fade_ms=config.interrupt_fade_ms,
            **kwargs,
        )

    @property
    def playing_utterance(self) -> str | None:
        return self._playing

    @property
    def samples_sent(self) -> int:
        """Samples handed to the sender so far; also the pts of the next frame."""
        return self._samples_sent

    # --- aiortc side ------------------------------------------------------------------------------

    async def recv(self) -> AudioFrame | Packet:
        while True:
            if self.readyState != "live":
                raise MediaStreamError
            await self._wait_for_deadline()
            if self.readyState != "live":
                raise MediaStreamError
            try:
                pcm = self._next_pcm()
            except Exception:  # never let aiortc's sender see anything but MediaStreamError
                logger.exception("track %s: reading the ring failed; sending silence", self.id)
                pcm = np.zeros(self.frame_samples, dtype=np.int16)
            action = FrameAction.SEND if self._dtx is None else self._dtx.action(not pcm.any())
            pts = self._samples_sent
            self._samples_sent += self.frame_samples
            self._frame_index += 1
            if action is FrameAction.SKIP:
                self.stats.dtx_frames += 1
                await self._sleep_in_dtx()
                continue
            self.stats.frames_sent += 1
            if action is FrameAction.DTX:
                self._silent_frames += 1
                return silence_packet(self._dtx_payload, pts)
            return self._silence_or_none(pcm, pts) or self._build_frame(pcm, pts)

    async def _sleep_in_dtx(self) -> None:
        """Skipped a frame: sleep until the ring has samples or the next DTX packet is due, then skip
        the frames whose time passed (the schedule resumes at the next frame due)."""
        assert self._dtx is not None and self._anchor_t is not None
        frames_left = self._dtx.frames_until_dtx()  # the DTX frame's index: _frame_index + frames_left - 1
        dtx_at = self._deadline(self._frame_index + frames_left - 1)
        self._data.clear()
        if self.ring.queued_samples == 0 and not len(self._fade_tail):
            await self._wait_data(self._data, max(0.0, dtx_at - self._clock()))
        now = self._clock()
        passed = int((now - self._deadline(self._frame_index)) // self._frame_s)  # frames due before now
        skipped = max(0, min(passed, frames_left - 1))
        self._dtx.skip(skipped)
        self._count_skipped(skipped)  # a stalled utterance's frames are underruns, DTX or not
        self.stats.dtx_frames += skipped
        self._frame_index += skipped
        self._samples_sent += skipped * self.frame_samples
        self._last_frame_t = None  # the pause was on purpose: not a gap

    def _silence_or_none(self, pcm: np.ndarray, pts: int) -> Packet | None:
        if pcm.any():
            self._silent_frames = 0
            return None
        self._silent_frames += 1
        if self._silence_payload is None or self._silent_frames <= SILENT_FRAMES_ENCODED:
            return None
        self.silence_packets += 1
        return silence_packet(self._silence_payload, pts)

    def _deadline(self, frame_index: int) -> float:
        assert self._anchor_t is not None
        return self._anchor_t + (frame_index - self._anchor_frame) * self._frame_s

    async def _wait_for_deadline(self) -> None:
        """Absolute schedule: frame n goes out at anchor + n * frame; re-anchor instead of bursting."""
        now = self._clock()
        if self._anchor_t is None:
            self._anchor_t, self._anchor_frame = now, self._frame_index
        deadline = self._deadline(self._frame_index)
        lag_s = now - deadline
        if lag_s > self._max_lag_s:
            logger.info("track %s: %.0f ms behind schedule, re-anchoring", self.id, lag_s * 1000)
            self._anchor_t, self._anchor_frame = now, self._frame_index
            self.stats.reanchors += 1
            self._count_skipped(int(lag_s / self._frame_s))
        elif deadline > now:
            await self._sleep(deadline - now)
            now = self._clock()  # the loop may wake us late
            lag_s = now - deadline
        if lag_s > self._frame_s:
            self.stats.late_frames += 1
        if self._last_frame_t is not None and now - self._last_frame_t > GAP_S:
            self.stats.gaps_over_100ms += 1
        self._last_frame_t = now

    def _count_skipped(self, frames: int) -> None:
        """Frames the re-anchor will never send: underruns when an utterance was playing."""
        if self._playing is not None and frames > 0:
            self.stats.underrun_frames += frames
            self._playback[self._playing].underrun_frames += frames

    def _build_frame(self, pcm: np.ndarray, pts: int) -> AudioFrame:
        # pcm: [frame_samples] int16 mono -> packed s16 frame [1, frame_samples * channels]
        if self.stereo:
            frame = AudioFrame.from_ndarray(np.repeat(pcm, 2)[None, :], format="s16", layout="stereo")
        else:
            frame = AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")
        frame.sample_rate = SAMPLE_RATE_HZ
        frame.pts = pts
        frame.time_base = TIME_BASE
        return frame

    def _next_pcm(self) -> np.ndarray:
        # -> [frame_samples] int16: the faded tail of an interrupt first, then the ring, then silence
        n = self.frame_samples
        tail, self._fade_tail = self._fade_tail[:n], self._fade_tail[n:]
        read = self.ring.read(n - len(tail))
        self._account(read.spans)
        pcm = np.concatenate((tail, read.pcm)) if len(tail) else read.pcm
        if len(pcm) < n:
            if self._playing is not None:
                self.stats.underrun_frames += 1
                self._playback[self._playing].underrun_frames += 1
            pcm = np.concatenate((pcm, np.zeros(n - len(pcm), dtype=np.int16)))
        return pcm

    # --- playout bookkeeping ------------------------------------------------------------------------

    def _account(self, spans: tuple[Span, ...]) -> None:
        for span in spans:
            uid = span.utterance_id
            if span.samples:
                if uid not in self._playback:
                    self._playback[uid] = _Playback()
                    self._emit(PlayoutEvent("started", uid))
                self._playback[uid].samples += span.samples
                self._playing = uid
            if span.ended:
                playback = self._playback.pop(uid, _Playback())
                if self._playing == uid:
                    self._playing = None
                played_ms = playback.samples * 1000.0 / SAMPLE_RATE_HZ
                logger.info(
                    "utterance %s: playout done, played_ms=%.0f underruns=%d",
                    uid,
                    played_ms,
                    playback.underrun_frames,
                )
                self._emit(PlayoutEvent("done", uid, played_ms, playback.underrun_frames))

    def _emit(self, event: PlayoutEvent) -> None:
        if self.on_playout is None:
            return
        try:
            self.on_playout(event)
        except Exception:
            logger.exception("utterance %s: on_playout callback failed", event.utterance_id)

    # --- barge-in ---------------------------------------------------------------------------------

    def interrupt(self) -> InterruptResult:
        """Flush: fade out the next `interrupt_fade_ms` of the playing utterance, then silence.

        The ring is cleared (generation bumped) so late writes of cancelled utterances are dropped.
        `played_ms` counts the faded tail, which is sent on the next frame(s).
        """
        uid = self._playing
        head = self.ring.clear(head_samples=self.fade_samples if uid is not None else 0)
        self.stats.interrupts += 1
        if uid is None:
            return InterruptResult(None, 0.0)
        # Keep only the playing utterance's continuation: a following utterance must not start here.
        spans, kept = [], 0
        for span in head.spans:
            if span.utterance_id != uid:
                break
            spans.append(span)
            kept += span.samples
        self._fade_tail = np.concatenate((self._fade_tail, fade_out(head.pcm[:kept])))
        played = self._playback[uid].samples + kept
        self._account(tuple(spans))
        if self._playing == uid:
            playback = self._playback.pop(uid)
            self._playing = None
            played_ms = playback.samples * 1000.0 / SAMPLE_RATE_HZ
            logger.info("utterance %s: interrupted after played_ms=%.0f", uid, played_ms)
            self._emit(PlayoutEvent("interrupted", uid, played_ms, playback.underrun_frames))
        self._playback.clear()
        return InterruptResult(uid, played * 1000.0 / SAMPLE_RATE_HZ)
