"""Decoded microphone frames go from aiortc's decoder thread straight to the call's listener.

aiortc decodes a remote track's packets on one thread per receiver and hands every decoded frame back
to the event loop (`run_coroutine_threadsafe(queue.put(frame))`: a loop wake-up and a task per 20 ms
frame), where a reader task awaits it only to pass it on to the call's listen thread. The loop never
looks at that audio. `install()` makes receivers run `decoder_worker` below: aiortc's decode loop,
except that a track whose queue was given a sink (`route_decoded(track, sink)`) has its frames handed
to the sink on the decoder thread. The end of the stream still goes through the queue, so the track's
`recv()` raises `MediaStreamError` as before; a track without a sink behaves exactly as in aiortc.
Measured with per-thread CPU on silent two-way calls (2026-11-26): README "CPU per listening call".

Jitter buffer: an audio RTP packet is one whole frame (RFC 7587), yet aiortc's audio jitter buffer
holds a frame until `prefetch` later ones arrived (80 ms; the call's `mic_jitter_frames` made it one
frame), and a DTX packet until the next packet, 400 ms later. `MicJitterBuffer` replaces it for
audio: a frame leaves as soon as every earlier one did; only behind a missing packet do later ones
wait for it (at most `max_wait_frames`, the call's `mic_jitter_frames`), and not behind DTX.

DTX: a caller asked for `usedtx=1` (`webrtc.dtx`) sends a long silence as one packet of at most 2
bytes, then nothing for up to 400 ms. The sender declared that time silent, so while the stream is in
DTX the decoder thread wakes every `filler.silence_tick_s()` and hands the listener that silence
up to `DTX_MARGIN_S` behind the wall clock (`fill_silence`): its VAD sees a speech end on time and its
readers get a continuous stream, at 10 wake-ups a second instead of 50 frames.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import av
from aiortc import jitterbuffer, rtcrtpreceiver
from aiortc.codecs import get_decoder
from aiortc.utils import uint16_add

logger = logging.getLogger(__name__)

FrameSink = Callable[[Any], None]
SINK_ATTR = "voicertc_sink"  # set on a RemoteStreamTrack's asyncio.Queue
FILLER_ATTR = "voicertc_filler"
DTX_MAX_BYTES = 2  # an Opus packet this short is DTX (a TOC byte, no frame data): what NetEq assumes
# silence is filled this far behind the wall clock: the caller's packets' jitter, and a stall of this
# process or of the caller's sender. Speech that resumes later than this after a DTX silence arrives for
# time already heard as silence and loses its head (the trim); at 40 ms, a loaded machine (the
# 2026-11-27 make test) split Chromium callers' questions in two this way
DTX_MARGIN_S = 0.12
AIORTC_JITTER_BUFFER = jitterbuffer.JitterBuffer


class SilenceFiller(Protocol):
    """Where a stream in DTX gets its declared silence (the call's listener)."""

    def fill_silence(self, until_pts: int, sample_rate_hz: int) -> None: ...

    def silence_tick_s(self) -> float: ...


def route_decoded(track: Any, sink: FrameSink, filler: SilenceFiller | None = None) -> bool:
    """Hand `track`'s decoded frames to `sink` on the decoder thread (and, while the caller is in DTX,
    its silence to `filler`); False when the track is not one of aiortc's remote tracks (its frames
    then keep arriving through `recv()`)."""
    frames = getattr(track, "_queue", None)
    if not isinstance(frames, asyncio.Queue):
        return False
    setattr(frames, SINK_ATTR, sink)
    setattr(frames, FILLER_ATTR, filler)
    return True


class JitterFrames(jitterbuffer.JitterFrame):
    """Several consecutive audio frames released at once: this one, then `more` as (RTP timestamp
    offset from this one, data). The receiver maps only this frame's timestamp; `frames()` applies
    the offsets to whatever it became."""

    def __init__(self, first: Any, more: list[tuple[int, bytes]]) -> None:
        super().__init__(data=first._data, timestamp=first.timestamp)
        self.more = more

    def frames(self) -> list[jitterbuffer.JitterFrame]:
        return [self] + [jitterbuffer.JitterFrame(data=d, timestamp=self.timestamp + o) for o, d in self.more]


class MicJitterBuffer:
    """aiortc's `JitterBuffer.add` for audio, where one RTP packet is one whole frame (RFC 7587): a
    packet is released as soon as every earlier one was; behind a missing packet at most
    `max_wait_frames` later ones wait for it, and none once the latest is DTX (nothing follows it
    for a while). A packet older than what was released (late, duplicated) is dropped and counted.
    Owned by the receiver's event loop task."""

    def __init__(self, max_wait_frames: int = 4) -> None:
        self.max_wait_frames = max_wait_frames
        self.next_seq: int | None = None
        self.dropped = 0  # packets that arrived after their place was passed
        self.skipped = 0  # missing packets given up on
        self._held: dict[int, Any] = {}

    def add(self, packet: Any) -> tuple[bool, jitterbuffer.JitterFrame | None]:
        seq: int = packet.sequence_number
        next_seq = seq if self.next_seq is None else self.next_seq
        if uint16_add(seq, -next_seq) >= 0x8000 or seq in self._held:
            self.dropped += 1
            return False, None
        self._held[seq] = packet
        out = self._release(next_seq)
        if not out and (len(self._held) > self.max_wait_frames or len(packet._data) <= DTX_MAX_BYTES):
            oldest = min(self._held, key=lambda held: uint16_add(held, -next_seq))
            self.skipped += uint16_add(oldest, -next_seq)
            out = self._release(oldest)
        if not out:
            return False, None
        first = out[0]
        more = [((p.timestamp - first.timestamp) % (1 << 32), p._data) for p in out[1:]]
        if more:
            return False, JitterFrames(first, more)
        return False, jitterbuffer.JitterFrame(first._data, first.timestamp)

    def _release(self, next_seq: int) -> list[Any]:
        """Every held packet from `next_seq` on without a gap, in order (`next_seq` moves past them)."""
        out = []
        while next_seq in self._held:
            out.append(self._held.pop(next_seq))
            next_seq = uint16_add(next_seq, 1)
        self.next_seq = next_seq
        return out


def jitter_buffer(capacity: int, prefetch: int = 0, is_video: bool = False) -> Any:
    """What aiortc's receiver builds as its jitter buffer: aiortc's for video, `MicJitterBuffer` for
    audio (waiting for a missing packet as long as aiortc's would, `prefetch` frames)."""
    if is_video:
        return AIORTC_JITTER_BUFFER(capacity=capacity, prefetch=prefetch, is_video=True)
    return MicJitterBuffer(max_wait_frames=max(1, prefetch))


@dataclass(frozen=True)
class DtxSince:
    """The stream went into DTX: its last frame ended at `pts_end` and arrived at `arrived_s`."""

    pts_end: int
    arrived_s: float
    sample_rate_hz: int

    def silent_until(self, now_s: float) -> int:
        """The pts up to which the caller's silence is due (`DTX_MARGIN_S` behind `now_s`)."""
        elapsed = max(0.0, now_s - self.arrived_s - DTX_MARGIN_S)
        return self.pts_end + int(elapsed * self.sample_rate_hz)


def _dtx_since(data: bytes, frames: list[Any]) -> DtxSince | None:
    if len(data) > DTX_MAX_BYTES or not frames or frames[-1].pts is None:
        return None
    last = frames[-1]
    return DtxSince(int(last.pts) + int(last.samples), time.monotonic(), int(last.sample_rate))


def _deliver(frames: list[Any], sink: FrameSink | None, out: asyncio.Queue, loop: Any) -> None:
    for frame in frames:
        if sink is None:
            asyncio.run_coroutine_threadsafe(out.put(frame), loop)
            continue
        try:
            sink(frame)
        except Exception:
            logger.exception("a decoded microphone frame was refused by its listener")


def decoder_worker(
    loop: asyncio.AbstractEventLoop,
    input_q: queue.Queue,
    output_q: asyncio.Queue,
    decode_error: threading.Event,
) -> None:
    """A receiver's decoder thread: (codec, encoded frame) items until None, as aiortc's; while the
    stream is in DTX it also wakes to fill the routed listener's silence."""
    codec_name = None
    decoder: Any = None
    dtx: DtxSince | None = None
    while True:
        filler: SilenceFiller | None = getattr(output_q, FILLER_ATTR, None)
        try:
            if dtx is None or filler is None:
                task = input_q.get()
            else:
                task = input_q.get(timeout=filler.silence_tick_s())
        except queue.Empty:
            if filler is not None and dtx is not None:
                _fill(filler, dtx)
            continue
        if task is None:
            asyncio.run_coroutine_threadsafe(output_q.put(None), loop)  # the track ends
            return
        codec, encoded = task
        if codec.name != codec_name:
            decoder = get_decoder(codec)
            codec_name = codec.name
        for encoded_frame in encoded.frames() if isinstance(encoded, JitterFrames) else [encoded]:
            try:
                frames = decoder.decode(encoded_frame)
            except av.FFmpegError as exc:
                # as aiortc: keep the decoder's state, report the error (a keyframe request for video)
                logger.warning("failed to decode a %s frame: %s", codec.name, exc)
                decode_error.set()
                continue
            _deliver(frames, getattr(output_q, SINK_ATTR, None), output_q, loop)
            dtx = _dtx_since(encoded_frame.data, frames)


def _fill(filler: SilenceFiller, dtx: DtxSince) -> None:
    try:
        filler.fill_silence(dtx.silent_until(time.monotonic()), dtx.sample_rate_hz)
    except Exception:
        logger.exception("a caller's DTX silence was refused by its listener")


def install() -> None:
    """Make every aiortc receiver started from now on use `decoder_worker` and, for audio, the
    arrival-order buffer (idempotent)."""
    rtcrtpreceiver.decoder_worker = decoder_worker
    rtcrtpreceiver.JitterBuffer = jitter_buffer  # type: ignore[assignment,misc]
