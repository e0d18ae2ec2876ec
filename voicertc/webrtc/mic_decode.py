"""Decoded microphone frames go from aiortc's decoder thread straight to the call's listener.

aiortc decodes a remote track's packets on one thread per receiver and hands every decoded frame back
to the event loop (`run_coroutine_threadsafe(queue.put(frame))`: a loop wake-up and a task per 20 ms
frame), where a reader task awaits it only to pass it on to the call's listen thread. The loop never
looks at that audio. `install()` makes receivers run `decoder_worker` below: aiortc's decode loop,
except that a track whose queue was given a sink (`route_decoded(track, sink)`) has its frames handed
to the sink on the decoder thread. The end of the stream still goes through the queue, so the track's
`recv()` raises `MediaStreamError` as before; a track without a sink behaves exactly as in aiortc.
Measured with per-thread CPU on silent two-way calls (2026-11-26): README "CPU per listening call".

Arrival order: an audio RTP packet is one whole frame (RFC 7587), so `ArrivalOrderBuffer` replaces
aiortc's audio jitter buffer, which holds 4 frames (80 ms) to put reordered packets back in order:
each packet is released as it arrives, and one older than the newest released (reordered, duplicated)
is dropped and counted (its 20 ms would be late; the listener hears a gap, filled with silence).

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
DTX_MARGIN_S = 0.04  # silence is filled this far behind the wall clock (the caller packets' jitter)
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


class ArrivalOrderBuffer:
    """aiortc's `JitterBuffer.add` for audio: every packet a frame, released on arrival (module doc).
    Owned by the receiver's event loop task."""

    def __init__(self) -> None:
        self.newest: int | None = None  # sequence number of the newest packet released
        self.dropped = 0  # packets older than `newest` (reordered or duplicated)

    def add(self, packet: Any) -> tuple[bool, jitterbuffer.JitterFrame | None]:
        seq = packet.sequence_number
        if self.newest is not None and not 0 < uint16_add(seq, -self.newest) < 0x8000:
            self.dropped += 1
            return False, None
        self.newest = seq
        return False, jitterbuffer.JitterFrame(data=packet._data, timestamp=packet.timestamp)


def jitter_buffer(capacity: int, prefetch: int = 0, is_video: bool = False) -> Any:
    """What aiortc's receiver builds as its jitter buffer: aiortc's for video, arrival order for audio."""
    if is_video:
        return AIORTC_JITTER_BUFFER(capacity=capacity, prefetch=prefetch, is_video=True)
    return ArrivalOrderBuffer()


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
            _fill(filler, dtx)
            continue
        if task is None:
            asyncio.run_coroutine_threadsafe(output_q.put(None), loop)  # the track ends
            return
        codec, encoded_frame = task
        if codec.name != codec_name:
            decoder = get_decoder(codec)
            codec_name = codec.name
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
