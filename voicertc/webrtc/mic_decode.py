"""Decoded microphone frames go from aiortc's decoder thread straight to the call's listener.

aiortc decodes a remote track's packets on one thread per receiver and hands every decoded frame back
to the event loop (`run_coroutine_threadsafe(queue.put(frame))`: a loop wake-up and a task per 20 ms
frame), where a reader task awaits it only to pass it on to the call's listen thread. The loop never
looks at that audio. `install()` makes receivers run `decoder_worker` below: aiortc's decode loop,
except that a track whose queue was given a sink (`route_decoded(track, sink)`) has its frames handed
to the sink on the decoder thread. The end of the stream still goes through the queue, so the track's
`recv()` raises `MediaStreamError` as before; a track without a sink behaves exactly as in aiortc.
Measured with per-thread CPU on silent two-way calls (2026-11-26): README "CPU per listening call".
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import av
from aiortc import rtcrtpreceiver
from aiortc.codecs import get_decoder

logger = logging.getLogger(__name__)

FrameSink = Callable[[Any], None]
SINK_ATTR = "voicertc_sink"  # set on a RemoteStreamTrack's asyncio.Queue


def route_decoded(track: Any, sink: FrameSink) -> bool:
    """Hand `track`'s decoded frames to `sink` on the decoder thread; False when the track is not one of
    aiortc's remote tracks (its frames then keep arriving through `recv()`)."""
    frames = getattr(track, "_queue", None)
    if not isinstance(frames, asyncio.Queue):
        return False
    setattr(frames, SINK_ATTR, sink)
    return True


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
    """A receiver's decoder thread: (codec, encoded frame) items until None, as aiortc's."""
    codec_name = None
    decoder: Any = None
    while True:
        task = input_q.get()
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


def install() -> None:
    """Make every aiortc receiver started from now on use `decoder_worker` (idempotent)."""
    rtcrtpreceiver.decoder_worker = decoder_worker
