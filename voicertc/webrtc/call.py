"""`Call`: one peer connection that speaks (and, with `[listen]`, hears) — track, sink, speech queue,
`events` data channel, microphone listener, liveness.

Runs on the event loop. A call is freed (engine utterances cancelled, ring dropped, tasks cancelled,
peer connection closed) when it is hung up, when its connection fails or closes, when its ICE/DTLS does
not connect within `webrtc.pending_timeout_s` (so offers that never connect do not hold `max_calls`
slots), when it is not fully set up (connected, and its data channel open if the offer had one) within
`webrtc.connect_timeout_s`, or when its data channel goes silent for `webrtc.keepalive_timeout_s` after
the client started pinging.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

import numpy as np
from aiortc import (
    MediaStreamTrack,
    RTCConfiguration,
    RTCDataChannel,
    RTCIceServer,
    RTCPeerConnection,
    RTCSessionDescription,
)
from aiortc.sdp import SessionDescription, candidate_from_sdp

from voicertc.audio import PcmRing, RingSink
from voicertc.config import Config
from voicertc.engine.protocol import Engine, SpeakOptions
from voicertc.errors import InputError, VoiceRTCError
from voicertc.listen.bargein import BargeInDecision
from voicertc.listen.listener import CallListener
from voicertc.validate import BadJsonError, SpeakRequest, SpeakRules, parse_json
from voicertc.webrtc import audio_level, mic_decode, opus_send
from voicertc.webrtc.dtx import ask_for_dtx
from voicertc.webrtc.loopback import loopback_only_sdp
from voicertc.webrtc.sctp_limits import limit_inbound_messages
from voicertc.webrtc.speech import ClientEvent, SpeechHandle, SpeechQueue, speak_rules
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
        self._max_message_bytes = 0  # the answer's max-message-size, once the offer had a data channel
        self.voice_check: Callable[[str], None] | None = None  # raises UnknownVoiceError (the owner's voices)
        self.loop = asyncio.get_running_loop()
        self.created_s = self.loop.time()
        audio_level.install()  # the sender's per-frame RTP audio level without a Python sample loop
        opus_send.install()  # the track's frames go to the Opus codec without aiortc's resampler
        mic_decode.install()  # the caller's decoded frames go to the listen thread past the loop
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
        self._on_close: list[Callable[[Call], object]] = []
        self.on_event: Callable[[ClientEvent], None] | None = None  # metrics hook
        self._watchdog: asyncio.Task[None] | None = None
        self.remote_ice: set[tuple[str, str]] = set()  # the offer's (ufrag, pwd) pairs
        self.ignored_media: list[str] = []  # offered media the answer turned down ("video")
        self.listener: CallListener | None = None  # set when the caller's microphone track arrives
        self._mic_offered = False
        self._listening = asyncio.Event()
        self.barge_ins = 0
        self._expects_channel = False  # the offer has an application m-line (a data channel comes)
        self._channel_seen = False
        self.pc.on("connectionstatechange", self._on_connection_state)
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("track", self._on_track)

    # --- signaling --------------------------------------------------------------------------------

    async def answer(self, offer_sdp: str) -> str:
        """Apply the browser's offer, attach the speech track, return the SDP answer (candidates gathered).

        An offer whose audio carries a microphone (sendrecv) is answered sendrecv when `[listen]
        enabled`: the mic goes to the call's listener, which always drains it. Otherwise audio is
        send-only (a receiving transceiver nobody reads would make aiortc queue the mic without bound).
        Video is never taken: its m-line is answered inactive and `ignored_media` says so.
        """
        if self.config.webrtc.loopback_only:
            offer_sdp = loopback_only_sdp(offer_sdp)
        parsed = SessionDescription.parse(offer_sdp)
        self.remote_ice = {
            (m.ice.usernameFragment, m.ice.password)
            for m in parsed.media
            if m.ice is not None and m.ice.usernameFragment and m.ice.password
        }
        self._expects_channel = any(m.kind == "application" for m in parsed.media)
        audio = [m for m in parsed.media if m.kind == "audio"]
        self._mic_offered = self.config.listen.enabled and any(
            m.direction in (None, "sendrecv", "sendonly") for m in audio[:1]
        )
        check_audio_codecs(audio[:1])
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
        if self.pc.sctp is not None:  # refuse data-channel messages over the answer's max-message-size
            self._max_message_bytes = limit_inbound_messages(self.pc.sctp, self._on_message_too_large)
        self.pc.addTrack(self.track)  # takes the offer's audio transceiver
        for transceiver in self.pc.getTransceivers():
            if transceiver.kind == "audio":
                ours = transceiver.sender.track is self.track
                transceiver.direction = (
                    ("sendrecv" if self._mic_offered else "sendonly") if ours else "inactive"
                )
            elif transceiver.kind == "video":
                transceiver.direction = "inactive"
                if "video" not in self.ignored_media:
                    self.ignored_media.append("video")
        if self.ignored_media:
            logger.info(
                "call %s: ignoring offered %s (audio only)", self.call_id, ", ".join(self.ignored_media)
            )
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        answer_sdp: str = self.pc.localDescription.sdp
        if sends_opus(answer_sdp):
            self.track.send_silence_as(opus_send.silence_payload(), dtx=self.config.webrtc.dtx)
        if self._mic_offered and self.config.webrtc.dtx:
            answer_sdp = ask_for_dtx(answer_sdp)  # the caller's silences as DTX (we read it, aiortc doesn't)
        self._watchdog = self.loop.create_task(self._watch(), name=f"call-{self.call_id}-watchdog")
        logger.info("call %s answered", self.call_id)
        return answer_sdp

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
        self,
        text: str | AsyncIterable[str],
        *,
        voice: str | None = None,
        interrupt: bool = False,
        instruct: str | None = None,
        speed: float | None = None,
    ) -> SpeechHandle:
        """Queue an utterance (text or async iterator of deltas); `interrupt` first stops what is playing.

        `instruct`: an instruction for the voice (CosyVoice instruct2); `speed`: a rate factor (CosyVoice2;
        like the reference, such an utterance is synthesized without streaming). The request is validated
        (`SpeakRequest.parse`) before the interrupt: a bad one leaves what is playing alone.
        """
        streamed = not isinstance(text, str)
        fields = {"text": text, "voice": voice, "interrupt": interrupt, "instruct": instruct, "speed": speed}
        request = SpeakRequest.parse(fields, self.speak_rules(), streamed=streamed)
        return self.speak_request(request, None if isinstance(text, str) else text)

    def speak_rules(self) -> SpeakRules:
        return speak_rules(self.speech.engine, self.config.limits)

    def speak_request(self, request: SpeakRequest, deltas: AsyncIterable[str] | None = None) -> SpeechHandle:
        """Queue a checked request; its text is `request.text`, or `deltas` when it streams in."""
        if self.closed.is_set():
            raise CallClosedError(f"call {self.call_id} is closed")
        text: str | AsyncIterable[str] | None = request.text if request.text is not None else deltas
        if text is None:
            raise InputError("a speak request needs its text or a stream of text deltas")
        options = SpeakOptions(instruct=request.instruct, speed=request.speed)
        voice = request.voice or self.default_voice
        if voice and self.voice_check is not None:
            self.voice_check(voice)  # a voice another token registered is unknown to this call
        if request.interrupt:
            self.speech.check_engine()
            self.interrupt()
        handle = self.speech.speak(text, voice, options)
        self.utterances += 1
        return handle

    def interrupt(self, *, barge_in: str | None = None) -> tuple[str | None, float]:
        """Stop playback now (fade), drop queued audio and utterances; returns (utterance_id, played_ms).

        `barge_in` ("speech" | "words"): the caller's voice did it (said so in `speech.interrupted`).
        """
        cut = self.track.interrupt()
        heard = self.sink.heard_text(cut.utterance_id, cut.played_ms)
        about, ms = self.speech.interrupt_all(cut.utterance_id, cut.played_ms, heard, barge_in)
        if about is not None:
            self.interrupts += 1
        logger.info("call %s interrupt: utterance %s at %.0f ms", self.call_id, about, ms)
        return about, ms

    # --- listening --------------------------------------------------------------------------------

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind != "audio" or not self._mic_offered or self.listener is not None:
            return  # video, or a mic we were not asked to hear: aiortc does not receive it
        if self.closed.is_set():
            return
        from voicertc.listen.transcriber import shared_transcriber

        listen = self.config.listen
        transcriber = (
            shared_transcriber(listen.whisper_threads, listen.whisper_workers, listen.transcript_queue)
            if listen.transcribe
            else None
        )
        self.listener = CallListener(
            self.call_id, listen, self._emit, self.current_utterance, self._on_barge_in, transcriber
        )
        self._shorten_mic_jitter_buffer(track)
        mic_decode.route_decoded(track, self.listener.thread.process_frame, self.listener.thread)
        self.listener.start(track)
        self._listening.set()
        logger.info("call %s: listening to the caller's microphone", self.call_id)

    def _shorten_mic_jitter_buffer(self, track: MediaStreamTrack) -> None:
        """A missing mic packet is waited for at most `mic_jitter_frames` later ones (every barge-in
        and VAD event pays the wait). aiortc offers no setting: the receiver's buffer is adjusted
        (`mic_decode.MicJitterBuffer`; aiortc's own buffer, should it be there, gets that prefetch)."""
        for transceiver in self.pc.getTransceivers():
            receiver = transceiver.receiver
            if receiver.track is not track:
                continue
            buffer = getattr(receiver, "_RTCRtpReceiver__jitter_buffer", None)
            if isinstance(buffer, mic_decode.MicJitterBuffer):
                buffer.max_wait_frames = self.config.listen.mic_jitter_frames
            elif buffer is not None and hasattr(buffer, "_prefetch"):
                buffer._prefetch = self.config.listen.mic_jitter_frames
            else:
                logger.info("call %s: aiortc jitter buffer not adjustable; kept", self.call_id)

    async def wait_listening(self) -> None:
        """Until the caller's microphone track arrived (never, for a call without one)."""
        await self._listening.wait()

    def current_utterance(self) -> str | None:
        """The agent's utterance playing now, else the oldest one queued; None when it is silent."""
        return self.track.playing_utterance or self.speech.first_pending()

    def _on_barge_in(self, decision: BargeInDecision) -> None:
        if self.closed.is_set():
            return
        about, played_ms = self.interrupt(barge_in=decision.reason)
        if about is not None:
            self.barge_ins += 1
        logger.info(
            "call %s barge-in (%s%s): utterance %s cut at %.0f ms",
            self.call_id,
            decision.reason,
            f": {decision.text!r}" if decision.text else "",
            about,
            played_ms,
        )

    async def listen(self) -> AsyncIterator[np.ndarray]:
        """The caller's microphone as 16 kHz mono int16 frames (20 ms each), until the call closes.

        One reader at a time reads the call's inbound buffer (`[listen] inbound_buffer_ms`; when
        nobody reads, the oldest audio is dropped and counted). A call without a microphone yields
        nothing and ends when the call closes.
        """
        if not self.config.listen.enabled:
            raise InputError("listening is off: set [listen] enabled = true")
        closed = asyncio.ensure_future(self.closed.wait())
        listening = asyncio.ensure_future(self._listening.wait())
        try:
            await asyncio.wait({closed, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            listening.cancel()
        if self.listener is None:
            return
        async for frame in self.listener.frames():
            yield frame

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

    def add_close_listener(self, callback: Callable[[Call], object]) -> None:
        """`callback(call)` runs when the call closes; at once when it already has."""
        if self.closed.is_set():
            callback(self)
        else:
            self._on_close.append(callback)

    def send_event(self, event: ClientEvent) -> None:
        """Tell the client something (data channel and every event subscriber), e.g. `call.closing`."""
        self._emit(event)

    def _emit(self, event: ClientEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)
        self._send_direct(event)
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
        self._channel_seen = True
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

    def _on_message_too_large(self, stream_id: int, held_bytes: int) -> None:
        """Runs inside aiortc's SCTP receive: only schedule the refusal."""
        self.loop.call_soon(self._refuse_channel, stream_id, held_bytes)

    def _refuse_channel(self, stream_id: int, held_bytes: int) -> None:
        logger.warning(
            "call %s: data channel message over %d bytes (%d held) on stream %d; closing the channel",
            self.call_id,
            self._max_message_bytes,
            held_bytes,
            stream_id,
        )
        self._emit(
            _error(
                "message_too_large",
                f"a data channel message passed {self._max_message_bytes} bytes (the answer's "
                "max-message-size); the channel is closed, the call goes on",
            )
        )
        if self.channel is not None and self.channel.id == stream_id:
            self.channel.close()

    def _dispatch(self, kind: Any, data: dict[str, Any]) -> None:
        if kind == "ping":
            self._send_direct({"type": "pong", "ts": data.get("ts")})
        elif kind == "speak":
            fields = {k: v for k, v in data.items() if k != "type"}
            self.speak_request(SpeakRequest.parse(fields, self.speak_rules()))  # emits speech.queued
        elif kind == "interrupt":
            self.interrupt()
        else:
            self._emit(_error("bad_message", f"unknown message type {kind!r}"))

    def _send_direct(self, event: ClientEvent) -> None:
        """Send on the data channel while its DTLS transport is connected. After a client vanished the
        channel may still say "open": a send then would fail in a task aiortc never awaits
        ("Cannot send encrypted data, not connected"), so nothing is sent."""
        channel = self.channel
        if channel is None or channel.readyState != "open" or not _dtls_connected(channel):
            return
        try:
            channel.send(json.dumps(event))
        except Exception:  # noqa: BLE001 - a dying channel must not break the others
            logger.debug("call %s: data channel send failed", self.call_id, exc_info=True)

    # --- liveness ---------------------------------------------------------------------------------

    async def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        logger.info("call %s connection %s", self.call_id, state)
        if state == "connected" and self.connected_s is None:
            self.connected_s = self.loop.time()
        elif state in ("failed", "closed"):
            await self.close(f"connection {state}")

    @property
    def set_up(self) -> bool:
        """Connected, and its data channel announced when the offer had one."""
        return self.connected_s is not None and (self._channel_seen or not self._expects_channel)

    async def _watch(self) -> None:
        """Close the call when it never connects or its data channel goes silent after pinging."""
        webrtc = self.config.webrtc
        while not self.closed.is_set():
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            now = self.loop.time()
            if self.connected_s is None and now - self.created_s > webrtc.pending_timeout_s:
                await self.close("pending timeout")  # close() never cancels its caller
                return
            if not self.set_up and now - self.created_s > webrtc.connect_timeout_s:
                await self.close("connect timeout")
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
            "late_frames": stats.late_frames,
            "gaps_over_100ms": stats.gaps_over_100ms,
            "frames_sent": stats.frames_sent,
            "dtx_frames": stats.dtx_frames,
            "barge_ins": self.barge_ins,
            "user_speech_segments": self.listener.speech_segments if self.listener else 0,
            "inbound_dropped_frames": self.listener.dropped_frames if self.listener else 0,
        }

    def info(self) -> dict[str, Any]:
        stats = self.track.stats
        return {
            "id": self.call_id,
            "state": self.state,
            "pending_utterances": self.speech.pending,
            "frames_sent": stats.frames_sent,
            "underrun_frames": stats.underrun_frames,
            "late_frames": stats.late_frames,
            "gaps_over_100ms": stats.gaps_over_100ms,
            "queued_ms": round(self.ring.queued_ms, 1),
            "listening": self.listener is not None,
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
        if self.listener is not None:
            await self.listener.close()
        await self.pc.close()


ACCEPTED_AUDIO_CODECS = ("opus", "pcmu", "pcma")


class UnsupportedCodecError(InputError):
    code = "unsupported_codec"


def sends_opus(answer_sdp: str) -> bool:
    """The answer's first audio codec (the one aiortc sends with) is 48 kHz stereo Opus."""
    audio = [m for m in SessionDescription.parse(answer_sdp).media if m.kind == "audio"]
    codecs = audio[0].rtp.codecs if audio else []
    return bool(codecs) and codecs[0].mimeType.lower() == "audio/opus" and codecs[0].clockRate == 48000


def check_audio_codecs(audio_media: list[Any]) -> None:
    """An audio m-line with no codec aiortc takes (Opus, PCMU, PCMA) cannot be answered: say which."""
    for media in audio_media:
        names = [codec.name for codec in media.rtp.codecs]
        if names and not any(n.lower() in ACCEPTED_AUDIO_CODECS for n in names):
            raise UnsupportedCodecError(
                f"the offer's audio codecs ({', '.join(names)}) are not taken here; offer opus, PCMU or PCMA"
            )


class CallClosedError(VoiceRTCError):
    code = "call_closed"


def _dtls_connected(channel: RTCDataChannel) -> bool:
    sctp = channel.transport
    return getattr(getattr(sctp, "transport", None), "state", None) == "connected"


def _error(code: str, message: str) -> ClientEvent:
    return {"type": "error", "code": code, "message": message}
