"""The live calls of one server: creation under `limits.max_calls`, lookup, metrics, shutdown.

Owned by the event loop. Embedding code waits on `next_call()` for calls as they are answered; only
then (`queue_new_calls`) are answered calls kept for it, so a plain server holds nothing per closed call.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import uuid
from collections import Counter, deque

from signaling.auth import ANONYMOUS, Principal
from signaling.errors import ApiError
from signaling.metrics import Metrics
from signaling.voice_owners import VoiceOwners
from voicertc.config import Config
from voicertc.engine.protocol import Engine
from voicertc.errors import EngineStoppedError, UnknownVoiceError
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
        self._owners: dict[str, str | None] = {}  # call id -> digest of the token that created it
        self._pending_keys: dict[str, str] = {}  # call id -> who it counts against for max_pending_calls
        self._reserved: Counter[str] = Counter()  # offers being answered right now, by pending key
        self.voice_owners: VoiceOwners | None = None  # set by the app: registered voices have owners
        self.queue_new_calls = False  # set by an embedder (VoiceServer) that takes calls with next_call()
        self._new_calls: deque[Call] = deque()  # answered, open, not yet taken by next_call()
        self._new_call_arrived = asyncio.Event()
        metrics.active_calls = lambda: len(self.calls)
        metrics.live_calls = self._live_counters
        metrics.engine_steps = lambda: engine.step_stats
        metrics.engine_batches = lambda: engine.batch_stats

    async def create(
        self,
        offer_sdp: str,
        voice: str | None = None,
        *,
        owner: Principal = ANONYMOUS,
        client: str = "",
    ) -> tuple[Call, str]:
        """Answer an offer as a new call of `owner`: (call, answer SDP). 503 when `limits.max_calls` are
        open; 429 when this token (or, without auth, this client address) has `limits.max_pending_calls`
        calls that have not connected yet."""
        if not self.engine.running:
            raise EngineStoppedError("the engine is not running; no calls can be answered")
        limits = self.config.limits
        if len(self.calls) + self._reserved.total() >= limits.max_calls:
            raise ApiError(
                503,
                "too_many_calls",
                f"{limits.max_calls} calls are open (limits.max_calls); try again later",
                {"Retry-After": str(RETRY_AFTER_S)},
            )
        key = owner.owner or f"client:{client}"
        if self.pending_calls(key) >= limits.max_pending_calls:
            retry_s = math.ceil(self.config.webrtc.pending_timeout_s)
            raise ApiError(
                429,
                "too_many_pending_calls",
                f"{limits.max_pending_calls} calls of this client have not connected yet "
                "(limits.max_pending_calls); connect them or wait",
                {"Retry-After": str(retry_s)},
            )
        if self.pending_total() >= limits.max_pending_total:
            raise ApiError(
                429,
                "too_many_pending_calls",
                f"{limits.max_pending_total} calls of all clients have not connected yet "
                "(limits.max_pending_total); try again when they connect or time out",
                {"Retry-After": str(math.ceil(self.config.webrtc.pending_timeout_s))},
            )
        if voice:
            self.check_voice(voice, owner)
        self._reserved[key] += 1
        try:
            call = Call(uuid.uuid4().hex[:16], self.engine, self.config, voice=voice)
            call.voice_check = functools.partial(self.check_voice_of, owner)
            try:
                answer = await call.answer(offer_sdp)
            except Exception as exc:
                await call.close("offer rejected")
                raise ApiError(
                    400, "bad_sdp", f"cannot answer the offer: {type(exc).__name__}: {exc}"
                ) from exc
        finally:
            self._reserved[key] -= 1
            if not self._reserved[key]:
                del self._reserved[key]
        if call.closed.is_set():  # its connection failed while the answer was being made
            raise ApiError(409, "call_closed", f"the call closed while it was answered ({call.close_reason})")
        self.calls[call.call_id] = call
        self._owners[call.call_id] = owner.owner
        self._pending_keys[call.call_id] = key
        call.on_event = self._count_event
        call.speech.on_synthesized = self.metrics.observe_engine
        call.add_close_listener(self._forget)
        self.metrics.calls_total += 1
        if self.queue_new_calls:
            self._new_calls.append(call)
            self._new_call_arrived.set()
        return call, answer

    def pending_calls(self, key: str) -> int:
        """Calls counted against `key` that are being answered or have not connected yet."""
        waiting = sum(
            1
            for call_id, call in self.calls.items()
            if call.connected_s is None and self._pending_keys.get(call_id) == key
        )
        return waiting + self._reserved[key]

    def pending_total(self) -> int:
        """Calls of every client being answered or not connected yet."""
        waiting = sum(1 for call in self.calls.values() if call.connected_s is None)
        return waiting + self._reserved.total()

    def voices_for(self, caller: Principal) -> list[str]:
        """The engine's voices `caller` may speak with (another token's registered voices left out)."""
        voices = list(self.engine.voices())
        return voices if self.voice_owners is None else self.voice_owners.visible(voices, caller)

    def check_voice(self, voice: str, caller: Principal = ANONYMOUS) -> None:
        """400 `unknown_voice` for a voice that does not exist or is another token's (the same answer)."""
        try:
            self.check_voice_of(caller, voice)
        except UnknownVoiceError as exc:
            raise ApiError(400, exc.code, str(exc)) from None

    def check_voice_of(self, caller: Principal, voice: str) -> None:
        voices = self.voices_for(caller)
        if voice not in voices:
            raise UnknownVoiceError(f"unknown voice {voice!r}; available: {', '.join(voices)}")

    def get(self, call_id: str, caller: Principal) -> Call:
        """The call, if `caller` may use it: another token's call is as unknown as a missing one."""
        call = self.calls.get(call_id)
        if call is None or not caller.may_use(self._owners.get(call_id)):
            raise ApiError(404, "unknown_call", f"no call {call_id!r} (hung up, timed out or never existed)")
        return call

    def count_for(self, caller: Principal) -> int:
        """Open calls `caller` may see."""
        return sum(1 for call_id in self.calls if caller.may_use(self._owners.get(call_id)))

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
        self._owners.pop(call.call_id, None)
        self._pending_keys.pop(call.call_id, None)
        if call in self._new_calls:
            self._new_calls.remove(call)
        logger.info("call %s freed (%s); %d open", call.call_id, call.close_reason, len(self.calls))

    async def close_all(self, reason: str = "server shutdown") -> None:
        await asyncio.gather(
            *(call.close(reason) for call in list(self.calls.values())), return_exceptions=True
        )
