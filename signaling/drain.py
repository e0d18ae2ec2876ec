"""Graceful drain: what SIGTERM does before the server stops.

Owned by the event loop. Once `Drain.run()` starts, `POST /v1/calls` answers 503 `draining` with
`Retry-After` (a load balancer sends the caller elsewhere) and `/readyz` answers 503; each open call
finishes the utterance it is speaking (or the first one queued) until `[server] drain_timeout_s` has
passed, then gets `call.closing {reason: "server_draining"}` and is closed. What is still unfinished
then is interrupted first (`speech.interrupted`): utterances still waiting for their turn at once
(nothing of them was played), one already synthesizing behind the current one as soon as the current
one's `speech.done` is out (at most one 20 ms frame of it was sent, then a fade), and the current one
itself at the deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from signaling.errors import error_response
from signaling.registry import CallRegistry
from voicertc.webrtc.call import Call

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CLOSING_REASON = "server_draining"
FLUSH_S = 0.2  # after call.closing: time for the data channel to put it on the wire before the close
RETRY_AFTER_S = 5


class Drain:
    """The server's drain state. `draining` never goes back to False."""

    def __init__(self, registry: CallRegistry, timeout_s: float) -> None:
        self.registry = registry
        self.timeout_s = timeout_s
        self.draining = False

    async def run(self) -> None:
        """Let every open call finish its current utterance (bounded by `timeout_s`), then close it."""
        if self.draining:
            return
        self.draining = True
        calls = list(self.registry.calls.values())
        logger.info("draining: %d open calls, up to %.1f s", len(calls), self.timeout_s)
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        results = await asyncio.gather(*(self._finish(c, deadline) for c in calls), return_exceptions=True)
        for call, result in zip(calls, results, strict=True):
            if isinstance(result, Exception):  # one call's failure must not stop the others' drain
                logger.warning("call %s: drain failed (%s); closing it", call.call_id, result)
                await call.close("server draining")
        logger.info("drained")

    async def _finish(self, call: Call, deadline: float) -> None:
        utterance_id = call.current_utterance()
        if utterance_id is not None:
            dropped = call.speech.cancel_queued()  # nothing new enters the ring behind the current one
            if dropped and dropped[0] == utterance_id:  # the current one was itself still waiting
                utterance_id = None
        handle = call.speech.get(utterance_id) if utterance_id else None
        if handle is not None and not call.closed.is_set():
            try:
                async with asyncio.timeout_at(deadline):
                    await handle.done()
                logger.info("call %s: utterance %s finished while draining", call.call_id, utterance_id)
            except TimeoutError:
                logger.info("call %s: utterance %s cut by the drain timeout", call.call_id, utterance_id)
        if call.closed.is_set():
            return
        if call.speech.pending:  # queued behind it, or the current one at the deadline: cut (faded)
            call.interrupt()
        call.send_event({"type": "call.closing", "reason": CLOSING_REASON})
        await asyncio.sleep(FLUSH_S)
        await call.close("server draining")


DRAIN = web.AppKey("drain", Drain)


def drain_middleware() -> Middleware:
    """503 `draining` for new calls once the app's `DRAIN` started (anything else is served as before)."""

    @web.middleware
    async def refuse_new_calls(request: web.Request, handler: Handler) -> web.StreamResponse:
        drain = request.app.get(DRAIN)
        if drain is not None and drain.draining and request.method == "POST" and request.path == "/v1/calls":
            return error_response(
                503,
                "draining",
                "this server is shutting down and takes no new calls; try again (another instance)",
                {"Retry-After": str(RETRY_AFTER_S)},
            )
        return await handler(request)

    return refuse_new_calls
