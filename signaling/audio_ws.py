"""`GET /v1/calls/{id}/audio`: the caller's microphone as a WebSocket of 16 kHz PCM16 binary frames.

For an agent in another process. The first message is a text frame describing the format; then every
binary message is 20 ms of 16 kHz mono signed 16-bit little-endian PCM. Each socket reads its own
bounded tap of the call's listener. A reader more than `[listen] ws_stall_timeout_s` behind is closed
with code 4008; the call closing ends it with 1000.

How far behind a reader is cannot be seen from the send side alone: the kernel buffers on both ends
hold many seconds of audio for a reader that stopped (26 s were seen). So every 200 ms of audio goes
out with a WebSocket ping whose payload numbers it; a client answers a ping when it has read up to it
(RFC 6455; browsers and aiohttp's `receive()` do), so the oldest unanswered ping's age is the
reader's lag. A reader that stops, and one that reads slower than real time, cross the limit within
`ws_stall_timeout_s` of falling behind. A send blocked that long, or the tap overflowing, also close it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import WSMsgType, web

from signaling.auth import principal
from signaling.errors import ApiError
from signaling.routes import REGISTRY
from voicertc.listen.inbound import LISTEN_RATE_HZ, InboundBuffer
from voicertc.webrtc.call import Call

logger = logging.getLogger(__name__)

audio_routes = web.RouteTableDef()

CLOSE_STALLED = 4008  # the reader fell behind for longer than ws_stall_timeout_s
CLOSE_CALL_ENDED = 1000
SEND_BUFFER_BYTES = 16 * 1024  # keep the kernel from hiding a stalled reader behind megabytes of buffer
NO_FRAME_YET = np.zeros(0, np.int16)
PING_EVERY_FRAMES = 10  # a numbered ping after every 200 ms of audio: its pong says the reader got there
FORMAT = {
    "type": "audio.format",
    "encoding": "pcm_s16le",
    "sample_rate_hz": LISTEN_RATE_HZ,
    "channels": 1,
    "frame_ms": 20,
}


@audio_routes.get("/v1/calls/{call_id}/audio")
async def call_audio(request: web.Request) -> web.StreamResponse:
    call = request.app[REGISTRY].get(request.match_info["call_id"], principal(request))
    listen = call.config.listen
    if not listen.enabled:
        raise ApiError(409, "listening_off", "this server does not listen ([listen] enabled = false)")
    ws = web.WebSocketResponse(autoping=False, heartbeat=None)  # pongs are ours to read (_drain_client)
    if not ws.can_prepare(request).ok:
        raise ApiError(
            426, "upgrade_required", "GET /v1/calls/{id}/audio is a WebSocket: send an Upgrade request"
        )
    await ws.prepare(request)
    _small_send_buffer(request)
    await ws.send_json({**FORMAT, "call_id": call.call_id})
    lag = ReaderLag()
    reader = asyncio.ensure_future(_drain_client(ws, lag))
    try:
        code, reason = await _stream(call, ws, listen.ws_stall_timeout_s, reader, lag)
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    if not ws.closed:
        await ws.close(code=code, message=reason.encode()[:120])
    return ws


@dataclass
class ReaderLag:
    """Pings in flight (number, monotonic send time), oldest first; a pong acknowledges its number and
    every older one. Owned by the event loop."""

    pings: deque[tuple[int, float]] = field(default_factory=deque)
    sent: int = 0

    def ping(self, now_s: float) -> bytes:
        self.sent += 1
        self.pings.append((self.sent, now_s))
        return struct.pack("!Q", self.sent)

    def pong(self, payload: bytes) -> None:
        if len(payload) != 8:
            return
        (number,) = struct.unpack("!Q", payload)
        while self.pings and self.pings[0][0] <= number:
            self.pings.popleft()

    def behind_s(self, now_s: float) -> float:
        """How long the oldest unanswered ping has waited (0 when all are answered)."""
        return now_s - self.pings[0][1] if self.pings else 0.0


async def _stream(
    call: Call, ws: web.WebSocketResponse, stall_s: float, reader: asyncio.Future[None], lag: ReaderLag
) -> tuple[int, str]:
    if not await _wait_listening(call, reader):
        return CLOSE_CALL_ENDED, f"call {call.call_id} ended"
    assert call.listener is not None
    tap = call.listener.tap(max_ms=1000.0 * stall_s)
    frames = 0
    try:
        while True:
            wait_s = stall_s - lag.behind_s(time.monotonic())
            if wait_s <= 0:
                break  # its pongs stopped coming back: the reader is stall_s behind
            frame = await _next_frame(tap, reader, wait_s)
            if frame is None:
                return CLOSE_CALL_ENDED, f"call {call.call_id} ended"
            if frame is NO_FRAME_YET:
                continue
            if tap.dropped_frames:
                break  # the tap overflowed: this reader is stall_s behind
            try:
                async with asyncio.timeout(stall_s):
                    await ws.send_bytes(frame.astype("<i2").tobytes())
                    frames += 1
                    if frames % PING_EVERY_FRAMES == 0:
                        await ws.ping(lag.ping(time.monotonic()))
            except TimeoutError:
                break
            except (ConnectionResetError, RuntimeError):
                return CLOSE_CALL_ENDED, "client went away"
    finally:
        if call.listener is not None:
            call.listener.untap(tap)
    logger.warning("call %s: audio WebSocket reader stalled for %.1f s; closing it", call.call_id, stall_s)
    return CLOSE_STALLED, f"reader stalled: more than {stall_s:g} s behind ([listen] ws_stall_timeout_s)"


async def _wait_listening(call: Call, reader: asyncio.Future[None]) -> bool:
    """Until the call's microphone arrives (True), or the call or the socket ends (False)."""
    if call.listener is not None:
        return True
    waiters = {asyncio.ensure_future(call.closed.wait()), asyncio.ensure_future(call.wait_listening())}
    try:
        pending: set[asyncio.Future[Any]] = {*waiters, reader}
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    return call.listener is not None and not call.closed.is_set() and not reader.done()


async def _next_frame(
    tap: InboundBuffer, reader: asyncio.Future[None], timeout_s: float
) -> np.ndarray | None:
    """The tap's next frame; None when the tap closed or the client went away first; NO_FRAME_YET when
    `timeout_s` passed first (time to look at the reader's lag again)."""
    getter = asyncio.ensure_future(tap.get())
    pending: set[asyncio.Future[Any]] = {getter, reader}
    await asyncio.wait(pending, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await getter
    return None if reader.done() else NO_FRAME_YET


async def _drain_client(ws: web.WebSocketResponse, lag: ReaderLag) -> None:
    """Read what the client sends: pongs (its progress), pings (answered), a close; the rest is ignored."""
    async for message in ws:
        if message.type == WSMsgType.PONG:
            lag.pong(message.data)
        elif message.type == WSMsgType.PING:
            with contextlib.suppress(ConnectionResetError, RuntimeError):
                await ws.pong(message.data)
        elif message.type in (WSMsgType.CLOSE, WSMsgType.ERROR):
            break


def _small_send_buffer(request: web.Request) -> None:
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
