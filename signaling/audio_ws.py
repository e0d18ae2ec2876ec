"""`GET /v1/calls/{id}/audio`: the caller's microphone as a WebSocket of 16 kHz PCM16 binary frames.

For an agent in another process. The first message is a text frame describing the format; then every
binary message is 20 ms of 16 kHz mono signed 16-bit little-endian PCM. Each socket reads its own
bounded tap of the call's listener. A reader that stalls (a send blocked, or its tap dropping audio,
for `[listen] ws_stall_timeout_s`) is closed with code 4008; the call closing ends it with 1000.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
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
    ws = web.WebSocketResponse(autoping=True, heartbeat=None)
    if not ws.can_prepare(request).ok:
        raise ApiError(
            426, "upgrade_required", "GET /v1/calls/{id}/audio is a WebSocket: send an Upgrade request"
        )
    await ws.prepare(request)
    _small_send_buffer(request)
    await ws.send_json({**FORMAT, "call_id": call.call_id})
    reader = asyncio.ensure_future(_drain_client(ws))
    try:
        code, reason = await _stream(call, ws, listen.ws_stall_timeout_s, reader)
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    if not ws.closed:
        await ws.close(code=code, message=reason.encode()[:120])
    return ws


async def _stream(
    call: Call, ws: web.WebSocketResponse, stall_s: float, reader: asyncio.Future[None]
) -> tuple[int, str]:
    if not await _wait_listening(call, reader):
        return CLOSE_CALL_ENDED, f"call {call.call_id} ended"
    assert call.listener is not None
    tap = call.listener.tap(max_ms=1000.0 * stall_s)
    try:
        while True:
            frame = await _next_frame(tap, reader)
            if frame is None:
                return CLOSE_CALL_ENDED, f"call {call.call_id} ended"
            if tap.dropped_frames:
                break  # the tap overflowed: this reader is stall_s behind
            try:
                await asyncio.wait_for(ws.send_bytes(frame.astype("<i2").tobytes()), stall_s)
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


async def _next_frame(tap: InboundBuffer, reader: asyncio.Future[None]) -> np.ndarray | None:
    """The tap's next frame; None when the tap closed or the client went away first."""
    getter = asyncio.ensure_future(tap.get())
    pending: set[asyncio.Future[Any]] = {getter, reader}
    await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    if not getter.done():
        getter.cancel()
        return None
    return getter.result()


async def _drain_client(ws: web.WebSocketResponse) -> None:
    """Read (and ignore) what the client sends, so its close and pings are handled."""
    async for message in ws:
        if message.type in (WSMsgType.CLOSE, WSMsgType.ERROR):
            break


def _small_send_buffer(request: web.Request) -> None:
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
