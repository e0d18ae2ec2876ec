"""Request bodies that never finish, and clients that leave in the middle of one. Runs on the event loop.

`body_guard` gives every request that has a body `[server] body_timeout_s` to deliver all of it (a
deadline on the whole body, so a slowloris that sends a byte now and then is cut as surely as a lying
Content-Length): past it the handler is cancelled, the answer is 408 `body_timeout` and the connection
is closed at once (aiohttp would otherwise linger reading it). Streaming speech (NDJSON on
`POST /v1/calls/{id}/speak`) has its own idle rule (`[limits] text_idle_timeout_s`) and is left to it.
A client that disconnects while its body is being read is not a server error: one INFO line, status
499 (nginx's "client closed request"), not counted among /metrics' HTTP errors, no traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from signaling.errors import error_response

logger = logging.getLogger(__name__)

CLIENT_CLOSED = 499
STREAMED_TYPES = ("application/x-ndjson",)  # bodies that are meant to stay open (their own idle timeout)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def body_guard(body_timeout_s: float) -> Middleware:
    """The middleware: a deadline on request bodies and a quiet 499 for clients that leave mid-body."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if not _has_pending_body(request):
                return await handler(request)
            return await _with_deadline(request, handler, body_timeout_s)
        except ConnectionResetError:
            # the client went away while we read its body (or wrote the answer): nothing to answer
            logger.info(
                "%s %s: client disconnected mid-request (%d bytes of the body read); 499",
                request.method,
                request.path,
                request.content.total_bytes,
            )
            return web.Response(status=CLIENT_CLOSED)

    return guard


def _has_pending_body(request: web.Request) -> bool:
    if not request.body_exists or request.content.is_eof():
        return False
    return request.content_type not in STREAMED_TYPES


async def _with_deadline(request: web.Request, handler: Handler, timeout_s: float) -> web.StreamResponse:
    task = asyncio.ensure_future(handler(request))
    loop = asyncio.get_running_loop()
    expired = False

    def check() -> None:
        nonlocal expired
        if not request.content.is_eof() and not task.done():
            expired = True
            task.cancel()

    timer = loop.call_later(timeout_s, check)
    try:
        return await task
    except asyncio.CancelledError:
        if not expired:
            raise  # the server is stopping or the request was cancelled: not ours to answer
        logger.info(
            "%s %s: the body did not arrive within %.1f s (%d bytes came); 408",
            request.method,
            request.path,
            timeout_s,
            request.content.total_bytes,
        )
        response = error_response(
            408,
            "body_timeout",
            f"the request body did not arrive within {timeout_s:g} s (server.body_timeout_s)",
        )
        await response.prepare(request)  # sent now, then the connection closes: no lingering on the body
        await response.write_eof()
        if request.protocol is not None:
            request.protocol.force_close()
        return response
    finally:
        timer.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
