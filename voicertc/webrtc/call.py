"""`Call`: one peer connection that speaks — track, sink, speech queue, `events` data channel, liveness.

Runs on the event loop. A call is freed (engine utterances cancelled, ring dropped, tasks cancelled,
peer connection closed) when it is hung up, when its connection fails or closes, when it does not
connect within `webrtc.connect_timeout_s`, or when its data channel goes silent for
`webrtc.keepalive_timeout_s` after the client started pinging.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterable, Callable
from typing import Any

from aiortc import RTCConfiguration, RTCDataChannel, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.sdp import SessionDescription, candidate_from_sdp

from voicertc.audio import PcmRing, RingSink
from voicertc.config import Config
from voicertc.engine.protocol import Engine
from voicertc.errors import VoiceRTCError
from voicertc.validate import BadJsonError, parse_json
from voicertc.webrtc.loopback import loopback_only_sdp
from voicertc.webrtc.speech import ClientEvent, SpeechHandle, SpeechQueue
from voicertc.webrtc.track import PlayoutEvent, SpeechTrack

logger = logging.getLogger(__name__)

EVENTS_CHANNEL = "events"
WATCHDOG_PERIOD_S = 0.5
RING_MARGIN_MS = 500.0


def ice_servers(config: Config) -> list[RTCIceServer]:
    """The configured STUN/TURN URLs; [] means host candidates only (never aiortc's default Google STUN)."""
    return [RTCIceServer(urls=url) for url in config.webrtc.ice_servers]


class Call:
    """One call. Owned by the event loop; create with `await Call.answer(...)`.

    Invariants: `closed` once set never clears; after close no engine utterance of this call is open
    and no task of it runs; every event goes to the data channel (when open) and every subscriber.
    """

    def __init__(self, call_id: str, engine: Engine, config: Config, *, voice: str | None = None) -> None:
        self.call_id = call_id
        self.config = config
        self.default_voice = voice
        self.loop = asyncio.get_running_loop()
        self.created_s = self.loop.time()
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=ice_servers(config)))
        self.ring = PcmRing(high_water_ms=config.engine.max_queued_ms, margin_ms=RING_MARGIN_MS)
        self.sink = RingSink(self.ring, trim_leading_ms=config.webrtc.trim_leading_silence_ms)
        self.track = SpeechTrack.from_config(self.ring, config.webrtc, on_playout=self._on_playout)
        self.speech = SpeechQueue(engine, self.sink, self._emit, limits=config.limits, call_id=call_id)
        self.channel: RTCDataChannel | None = None
        self.closed = asyncio.Event()
        self.close_reason = ""
        self.last_ping_s: float | None = None
        self.connected_s: float | None = None
        self.interrupts = 0
        self.utterances = 0
        self._subscribers: list[asyncio.Queue[ClientEvent | None]] = []
        self._overflowed: set[asyncio.Queue[ClientEvent | None]] = set()
        self._on_close: list[Callable[[Call], None]] = []
        self.on_event: Callable[[ClientEvent], None] | None = None  # metrics hook
        self._watchdog: asyncio.Task[None] | None = None
        self.remote_ice: set[tuple[str, str]] = set()  # the offer's (ufrag, pwd) pairs
        self.pc.on("connectionstatechange", self._on_connection_state)
        self.pc.on("datachannel", self._on_datachannel)

    # --- signaling --------------------------------------------------------------------------------

    async def answer(self, offer_sdp: str) -> str:
        """Apply the browser's offer, attach the speech track, return the SDP answer (candidates gathered).

        Audio is answered send-only: the server never listens, and a receiving transceiver would make
        aiortc decode and queue a sendrecv offer's microphone without bound.
        """
        if self.config.webrtc.loopback_only:
            offer_sdp = loopback_only_sdp(offer_sdp)
        self.remote_ice = {
            (m.ice.usernameFragment, m.ice.password)
            for m in SessionDescription.parse(offer_sdp).media
            if m.ice.usernameFragment and m.ice.password
        }
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
        self.pc.addTrack(self.track)  # takes the offer's audio transceiver
        for transceiver in self.pc.getTransceivers():
            if transceiver.kind == "audio":
                ours = transceiver.sender.track is self.track
                transceiver.direction = "sendonly" if ours else "inactive"
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        self._watchdog = self.loop.create_task(self._watch(), name=f"call-{self.call_id}-watchdog")
        logger.info("call %s answered", self.call_id)
        return self.pc.localDescription.sdp

    async def add_remote_candidates(
        self, candidate_lines: list[tuple[str | None, str]], *, end: bool = False
    ) -> None:
        """Trickled remote candidates: (mid, 'candidate:...' attribute value) pairs; `end` passes on
        the peer's end-of-candidates so ICE stops waiting for more."""
        for mid, line in candidate_lines:
            if self.config.webrtc.loopback_only and not loopback_only_sdp("a=" + line + "\r\n"):
                continue
            candidate = candidate_from_sdp(line.removeprefix("a=").removeprefix("candidate:"))
            candidate.sdpMid = mid
            candidate.sdpMLineIndex = 0 if mid is None else None
            await self.pc.addIceCandidate(candidate)
        if end:
            await self.pc.addIceCandidate(None)

    # --- speaking ---------------------------------------------------------------------------------

    def speak(
        self, text: str | AsyncIterable[str], *, voice: str | None = None, interrupt: bool = False
    ) -> SpeechHandle:
        """Queue an utterance (text or async iterator of deltas); `interrupt` first stops what is playing.

        The request is validated before the interrupt: a bad one leaves what is playing alone.
        """
        if self.closed.is_set():
            raise CallClosedError(f"call {self.call_id} is closed")
        voice = voice or self.default_voice
        if interrupt:
            self.speech.check(text, voice)
            self.interrupt()
        handle = self.speech.speak(text, voice)
        self.utterances += 1
        return handle

    def interrupt(self) -> tuple[str | None, float]:
        """Stop playback now (fade), drop queued audio and utterances; returns (utterance_id, played_ms)."""
        cut = self.track.interrupt()
        about, ms = self.speech.interrupt_all(cut.utterance_id, cut.played_ms)
        if about is not None:
            self.interrupts += 1
        logger.info("call %s interrupt: utterance %s at %.0f ms", self.call_id, about, ms)
        return about, ms

    # --- events -----------------------------------------------------------------------------------

    def subscribe(self, max_events: int = 0) -> asyncio.Queue[ClientEvent | None]:
        """A queue that receives every event from now on; `None` marks its end (the call closed, or,
        with `max_events` > 0, the reader fell that far behind and was dropped: see `overflowed`)."""
        queue: asyncio.Queue[ClientEvent | None] = asyncio.Queue(max_events + 1 if max_events else 0)
        if self.closed.is_set():
            queue.put_nowait(None)
        else:
            self._subscribers.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[ClientEvent | None]) -> None:
        if queue in self._subscribers:
            self._subscribers.remove(queue)
        self._overflowed.discard(queue)

    def overflowed(self, queue: asyncio.Queue[ClientEvent | None]) -> bool:
        """True when `queue` was dropped for falling behind (its `None` does not mean the call closed)."""
        return queue in self._overflowed

    def add_close_listener(self, callback: Callable[[Call], None]) -> None:
        """`callback(call)` runs when the call closes; at once when it already has."""
        if self.closed.is_set():
            callback(self)
        else:
            self._on_close.append(callback)

    def _emit(self, event: ClientEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)
        channel = self.channel
        if channel is not None and channel.readyState == "open":
            try:
                channel.send(json.dumps(event))
            except Exception:  # noqa: BLE001 - a dying channel must not break the others
                logger.debug("call %s: data channel send failed", self.call_id, exc_info=True)
        for queue in list(self._subscribers):
            if not queue.maxsize or queue.qsize() < queue.maxsize - 1:
                queue.put_nowait(event)
                continue
            # a slow reader: drop it instead of buffering forever (the last slot holds its end mark)
            logger.warning("call %s: an event subscriber fell behind; dropping it", self.call_id)
            self._subscribers.remove(queue)
            self._overflowed.add(queue)
            queue.put_nowait(None)

    def _on_playout(self, event: PlayoutEvent) -> None:
        if event.kind == "started":
            self.speech.playout_started(event.utterance_id)
        elif event.kind == "done":
            self.speech.playout_done(event.utterance_id, event.played_ms)
        # "interrupted" is reported by interrupt() itself, with the same played_ms

    # --- data channel -----------------------------------------------------------------------------

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != EVENTS_CHANNEL:
            logger.info("call %s: ignoring data channel %r", self.call_id, channel.label)
            return
        self.channel = channel
        channel.on("message", self._on_message)

    def _on_message(self, message: str | bytes) -> None:
        self.last_ping_s = self.loop.time()
        try:
            data = parse_json(message, "data channel message")
        except BadJsonError as exc:
            self._emit(_error("bad_message", f"data channel messages must be JSON objects ({exc})"))
            return
        if not isinstance(data, dict):
            self._emit(_error("bad_message", "data channel messages must be JSON objects"))
            return
        kind = data.get("type")
        try:
            self._dispatch(kind, data)
        except VoiceRTCError as exc:
            self._emit(_error(exc.code, str(exc)))

    def _dispatch(self, kind: Any, data: dict[str, Any]) -> None:
        if kind == "ping":
            self._send_direct({"type": "pong", "ts": data.get("ts")})
        elif kind == "speak":
            text = data.get("text")
            if not isinstance(text, str):
                self._emit(_error("bad_message", "speak needs a string 'text'"))
                return
            voice = data.get("voice") if isinstance(data.get("voice"), str) else None
            self.speak(text, voice=voice, interrupt=bool(data.get("interrupt", False)))  # emits speech.queued
        elif kind == "interrupt":
            self.interrupt()
        else:
            self._emit(_error("bad_message", f"unknown message type {kind!r}"))

    def _send_direct(self, event: ClientEvent) -> None:
        """A reply for the data channel only (pong)."""
        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(json.dumps(event))

    # --- liveness ---------------------------------------------------------------------------------

    async def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        logger.info("call %s connection %s", self.call_id, state)
        if state == "connected" and self.connected_s is None:
            self.connected_s = self.loop.time()
        elif state in ("failed", "closed"):
            await self.close(f"connection {state}")

    async def _watch(self) -> None:
        """Close the call when it never connects or its data channel goes silent after pinging."""
        webrtc = self.config.webrtc
        while not self.closed.is_set():
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            now = self.loop.time()
            if self.connected_s is None and now - self.created_s > webrtc.connect_timeout_s:
                await self.close("connect timeout")  # close() never cancels its caller
                return
            if self.last_ping_s is not None and now - self.last_ping_s > webrtc.keepalive_timeout_s:
                await self.close("keepalive timeout")
                return

    @property
    def state(self) -> str:
        return "closed" if self.closed.is_set() else self.pc.connectionState

    def counters(self) -> dict[str, int]:
        """Totals for /metrics (see signaling.metrics.CALL_COUNTERS)."""
        stats = self.track.stats
        return {
            "utterances": self.utterances,
            "interrupts": self.interrupts,
            "underrun_frames": stats.underrun_frames,
            "frames_sent": stats.frames_sent,
        }

    def info(self) -> dict[str, Any]:
        stats = self.track.stats
        return {
            "id": self.call_id,
            "state": self.state,
            "pending_utterances": self.speech.pending,
            "frames_sent": stats.frames_sent,
            "underrun_frames": stats.underrun_frames,
            "queued_ms": round(self.ring.queued_ms, 1),
        }

    async def close(self, reason: str = "hang up") -> None:
        """Free everything this call holds; safe to call more than once and from its own callbacks."""
        if self.closed.is_set():
            return
        self.closed.set()
        self.close_reason = reason
        logger.info("call %s closing: %s", self.call_id, reason)
        self.speech.close()
        self.ring.clear()
        self.sink.set_space_listener(None)
        if self._watchdog is not None and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()
        for queue in self._subscribers:
            queue.put_nowait(None)  # every live queue has a free slot (see _emit)
        self._subscribers.clear()
        for callback in self._on_close:
            try:
                callback(self)
            except Exception:
                logger.exception("call %s: close listener failed", self.call_id)
        self.track.stop()
        await self.pc.close()


class CallClosedError(VoiceRTCError):
    code = "call_closed"


def _error(code: str, message: str) -> ClientEvent:
    return {"type": "error", "code": code, "message": message}
