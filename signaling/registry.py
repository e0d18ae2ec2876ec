"""The live calls of one server: creation under `limits.max_calls`, lookup, metrics, shutdown.

Owned by the event loop. Embedding code waits on `next_call()` for calls as they are answered; only
then (`queue_new_calls`) are answered calls kept for it, so a plain server holds nothing per closed call.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque

from signaling.errors import ApiError
from signaling.metrics import Metrics
from voicertc.config import Config
from voicertc.engine.protocol import Engine
from voicertc.errors import EngineStoppedError
from voicertc.webrtc.call import Call
from voicertc.webrtc.speech import ClientEvent

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5


class CallRegistry:
    """Every call of the server by id. A call leaves the registry as soon as it closes, for any reason."""

    def __init__(self, engine: Engine, config: Config, metrics: Metrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.calls: dict[str, Call] = {}
        self._reserved = 0  # offers being answered right now count against max_calls
        self.queue_new_calls = False  # set by an embedder (VoiceServer) that takes calls with next_call()
        self._new_calls: deque[Call] = deque()  # answered, open, not yet taken by next_call()
        self._new_call_arrived = asyncio.Event()
        metrics.active_calls = lambda: len(self.calls)
        metrics.live_calls = self._live_counters
        metrics.engine_steps = lambda: getattr(engine, "step_stats", None)

    async def create(self, offer_sdp: str, voice: str | None = None) -> tuple[Call, str]:
        """Answer an offer as a new call: (call, answer SDP). 503 when `limits.max_calls` are open."""
        if not getattr(self.engine, "running", True):
            raise EngineStoppedError("the engine is not running; no calls can be answered")
        if len(self.calls) + self._reserved >= self.config.limits.max_calls:
            raise ApiError(
                503,
                "too_many_calls",
                f"{self.config.limits.max_calls} calls are open (limits.max_calls); try again later",
                {"Retry-After": str(RETRY_AFTER_S)},
            )
        if voice:
            self.check_voice(voice)
        self._reserved += 1
        try:
            call = Call(uuid.uuid4().hex[:16], self.engine, self.config, voice=voice)
            try:
                answer = await call.answer(offer_sdp)
            except Exception as exc:
                await call.close("offer rejected")
                raise ApiError(
                    400, "bad_sdp", f"cannot answer the offer: {type(exc).__name__}: {exc}"
                ) from exc
        finally:
            self._reserved -= 1
        if call.closed.is_set():  # its connection failed while the answer was being made
            raise ApiError(409, "call_closed", f"the call closed while it was answered ({call.close_reason})")
        self.calls[call.call_id] = call
        call.on_event = self._count_event
        call.speech.on_synthesized = self.metrics.observe_engine
        call.add_close_listener(self._forget)
        self.metrics.calls_total += 1
        if self.queue_new_calls:
            self._new_calls.append(call)
            self._new_call_arrived.set()
        return call, answer

    def check_voice(self, voice: str) -> None:
        voices = self.engine.voices()
        if voice not in voices:
            raise ApiError(400, "unknown_voice", f"unknown voice {voice!r}; available: {', '.join(voices)}")

    def get(self, call_id: str) -> Call:
        call = self.calls.get(call_id)
        if call is None:
            raise ApiError(404, "unknown_call", f"no call {call_id!r} (hung up, timed out or never existed)")
        return call

    async def next_call(self) -> Call:
        """The next open call not taken yet (answered since `queue_new_calls` was set), oldest first."""
        self.queue_new_calls = True
        while not self._new_calls:
            self._new_call_arrived.clear()
            await self._new_call_arrived.wait()
        return self._new_calls.popleft()

    def _count_event(self, event: ClientEvent) -> None:
        kind = event["type"]
        if kind == "speech.started":
            self.metrics.ttfa.observe(event["ttfa_ms"] / 1000.0)
        elif kind == "error":
            self.metrics.error(event["code"])

    def _live_counters(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for call in self.calls.values():
            for name, value in call.counters().items():
                totals[name] = totals.get(name, 0) + value
        return totals

    def _forget(self, call: Call) -> None:
        if self.calls.pop(call.call_id, None) is not None:
            self.metrics.add_closed(call.counters())
        if call in self._new_calls:
            self._new_calls.remove(call)
        logger.info("call %s freed (%s); %d open", call.call_id, call.close_reason, len(self.calls))

    async def close_all(self, reason: str = "server shutdown") -> None:
        await asyncio.gather(
            *(call.close(reason) for call in list(self.calls.values())), return_exceptions=True
        )
