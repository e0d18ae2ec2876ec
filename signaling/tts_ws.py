"""`GET /v1/tts/stream`: a WebSocket session that takes text deltas and sends audio as it is made.

Client -> server (JSON text messages):
  {"type": "session.update", "voice"?, "format"?, "sample_rate"?, "instruct"?, "binary"?}
      settings for the utterances that start after it (voice: our ids or an OpenAI name = the default;
      format "pcm_s16le"; sample_rate 8000..48000, default 24000; binary false = audio as base64 JSON)
  {"type": "text.delta", "text", "flush"?}  text for the open utterance (the first delta after a flush
                                   opens one); "flush": true = this is its last text (a text.flush after it)
  {"type": "text.flush"}           the open utterance has all its text: speak it to the end
  {"type": "cancel"}               stop now: every utterance of the session ends, buffered text is dropped
Server -> client:
  session.created / session.updated {session}; speech.queued {utterance_id} (when its first text came);
  speech.started {utterance_id, ttfa_ms}; speech.mark {utterance_id, text, audio_ms} before the audio
  it speaks (the engine's text pieces; audio_ms = where that audio starts); the audio: binary frames
  of PCM16 LE mono (each at most FRAME_MS), or {"type": "speech.audio.delta", utterance_id, audio:
  base64} when binary is false; then exactly one of speech.done {utterance_id, audio_ms, interrupted}
  or error {utterance_id, code, message}. Utterances are sent one after another, never interleaved:
  the binary frames between an utterance's speech.started and its end belong to it. `error` without
  utterance_id refuses one message (bad_json, unknown_type, binary_not_accepted, bad_text, ...); the
  session goes on.
Close codes: 1000 when the client closes; 1009 for a message over the size limit; 4408 after
`[limits] text_idle_timeout_s` with no message while nothing is being spoken.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSMsgType, web

from signaling.errors import ApiError
from signaling.routes import REGISTRY
from signaling.speech_api import checked_options, map_voice, open_error
from voicertc.config import Config
from voicertc.engine.protocol import Engine, Failed, SpeakOptions
from voicertc.errors import VoiceRTCError
from voicertc.streaming import STREAM_RATE_HZ, SpeechStream
from voicertc.validate import BadJsonError, BadTextError, check_text, parse_json

logger = logging.getLogger(__name__)

tts_ws_routes = web.RouteTableDef()

FRAME_MS = 40  # audio per binary message: a cancel stops the audio within one of these
SAMPLE_RATES_HZ = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
FORMATS = ("pcm_s16le",)
CLOSE_IDLE = 4408
BYTES_PER_CHAR = 6  # a JSON \uXXXX escape per character, at worst
MESSAGE_SLACK_BYTES = 4096


@dataclass
class SessionSettings:
    voice: str | None = None
    format: str = "pcm_s16le"
    sample_rate: int = STREAM_RATE_HZ
    instruct: str = ""
    binary: bool = True
    options: SpeakOptions = field(default_factory=SpeakOptions)

    def describe(self) -> dict[str, Any]:
        return {
            "voice": self.voice,
            "format": self.format,
            "sample_rate": self.sample_rate,
            "instruct": self.instruct,
            "binary": self.binary,
        }


@dataclass
class _Utterance:
    stream: SpeechStream
    binary: bool
    first_text_s: float | None = None
    pending: list[str] = field(default_factory=list)  # text that came before it opened in the engine
    text_chars: int = 0
    input_ended: bool = False
    opened: asyncio.Event = field(default_factory=asyncio.Event)  # opened, or refused (reported)
    reported: bool = False  # its one terminal message went out

    @property
    def utterance_id(self) -> str:
        return self.stream.utterance_id


class _MessageError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@tts_ws_routes.get("/v1/tts/stream")
async def tts_stream(request: web.Request) -> web.StreamResponse:
    registry = request.app[REGISTRY]
    max_bytes = BYTES_PER_CHAR * registry.config.limits.max_text_chars + MESSAGE_SLACK_BYTES
    ws = web.WebSocketResponse(autoping=True, heartbeat=None, max_msg_size=max_bytes)
    if not ws.can_prepare(request).ok:
        raise ApiError(426, "upgrade_required", "GET /v1/tts/stream is a WebSocket: send an Upgrade request")
    await ws.prepare(request)
    session = TtsSession(ws, registry.engine, registry.config)
    await session.run()
    return ws


class TtsSession:
    """One WebSocket's utterances, in order. Owned by the event loop.

    At most one utterance of a session is open in the engine; the next opens when the engine has all
    of the previous one's audio (it waits in the stream's bounded buffer while it is sent). The sender
    task sends utterances one after another; the receive loop never waits on the engine.
    """

    def __init__(self, ws: web.WebSocketResponse, engine: Engine, config: Config) -> None:
        self.ws = ws
        self.engine = engine
        self.config = config
        self.idle_s = config.limits.text_idle_timeout_s
        self.settings = SessionSettings()
        self._utterances: deque[_Utterance] = deque()  # not yet reported, in order
        self._open: _Utterance | None = None  # open in the engine, outcome not yet in
        self._added = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._last_sent_s = 0.0  # loop time the previous utterance's audio ended
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        sender = asyncio.ensure_future(self._send_loop())
        try:
            await self._send({"type": "session.created", "session": self.settings.describe()})
            await self._receive_loop()
        finally:
            self._cancel_all()
            for task in (sender, *self._tasks):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(sender, *self._tasks, return_exceptions=True)
            if not self.ws.closed:
                await self.ws.close()

    # --- client -> server -------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while not self.ws.closed:
            try:
                message = await self.ws.receive(timeout=self.idle_s)
            except TimeoutError:
                if self._speaking():
                    continue
                reason = f"no message for {self.idle_s:g} s ([limits] text_idle_timeout_s)"
                await self._send({"type": "error", "code": "idle_timeout", "message": reason})
                await self.ws.close(code=CLOSE_IDLE, message=reason.encode()[:120])
                return
            if message.type == WSMsgType.TEXT:
                try:
                    await self._handle(message.data)
                except _MessageError as exc:
                    await self._send({"type": "error", "code": exc.code, "message": str(exc)})
                except ApiError as exc:  # a refused session.update field (voice, instruct)
                    await self._send({"type": "error", "code": exc.code, "message": exc.message})
            elif message.type == WSMsgType.BINARY:
                text = "binary messages are not accepted: send JSON text messages"
                await self._send({"type": "error", "code": "binary_not_accepted", "message": text})
            else:  # CLOSE, CLOSING, CLOSED, ERROR (e.g. a message over the size limit: closed with 1009)
                if message.type == WSMsgType.ERROR:
                    logger.info("tts stream: closed on a protocol error: %s", message.data)
                return

    def _speaking(self) -> bool:
        return any(u.input_ended for u in self._utterances)

    async def _handle(self, raw: str) -> None:
        try:
            data = parse_json(raw.encode("utf-8", "surrogatepass"), "message")
        except BadJsonError as exc:
            raise _MessageError(exc.code, str(exc)) from None
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            raise _MessageError("bad_message", 'a message must be a JSON object with a string "type"')
        kind = data["type"]
        if kind == "text.delta":
            flush = data.get("flush", False)
            if not isinstance(flush, bool):
                raise _MessageError("bad_request", '"flush" must be true or false')
            await self._text_delta(data.get("text"), flush)
            if flush:  # ends what the delta did not (no text: nothing to speak is then reported)
                self._flush()
        elif kind == "text.flush":
            self._flush()
        elif kind == "cancel":
            for utt in self._cancel_all():
                await self._send(_done(utt, interrupted=True))
        elif kind == "session.update":
            self.settings = self._updated(data)
            await self._send({"type": "session.updated", "session": self.settings.describe()})
        else:
            known = "session.update, text.delta, text.flush, cancel"
            raise _MessageError("unknown_type", f"unknown message type {kind!r}; known: {known}")

    def _updated(self, data: dict[str, Any]) -> SessionSettings:
        """The session settings with `data` applied; the whole message is refused if one field is bad."""
        s = self.settings
        voice = map_voice(self.engine, data["voice"]) if "voice" in data else s.voice
        fmt = data.get("format", s.format)
        if fmt not in FORMATS:
            raise _MessageError("bad_request", f'"format" must be one of {", ".join(FORMATS)}; got {fmt!r}')
        rate = data.get("sample_rate", s.sample_rate)
        if isinstance(rate, bool) or rate not in SAMPLE_RATES_HZ:
            rates = ", ".join(map(str, SAMPLE_RATES_HZ))
            raise _MessageError("bad_request", f'"sample_rate" must be one of {rates}; got {rate!r}')
        binary = data.get("binary", s.binary)
        if not isinstance(binary, bool):
            raise _MessageError("bad_request", '"binary" must be true or false')
        instruct = data.get("instruct", s.instruct) or ""
        options = checked_options(self.engine, instruct, None, "instruct")
        return SessionSettings(voice, fmt, rate, options.instruct, binary, options)

    async def _text_delta(self, text: object, end: bool = False) -> None:
        """Add text to the open utterance (or a new one); `end`: the whole text in one message, which
        reaches the engine with its end in one command (never as deltas and a separate end)."""
        if not isinstance(text, str):
            raise _MessageError("bad_request", 'text.delta needs "text": a string')
        try:
            check_text(text, "text")
        except BadTextError as exc:
            raise _MessageError(exc.code, str(exc)) from None
        if not text:
            return
        utt = self._input_utterance()
        if utt is None:
            limit = self.config.limits.max_queued_utterances
            if len(self._utterances) >= limit:
                message = (
                    f"{limit} utterances are already queued or speaking ([limits] max_queued_utterances)"
                )
                raise _MessageError("too_many_utterances", message)
            utt = self._new_utterance()
            await self._send({"type": "speech.queued", "utterance_id": utt.utterance_id})
            self._pump()
        if utt.first_text_s is None and text.strip():
            utt.first_text_s = self._loop.time()
        utt.text_chars += len(text)
        limit = self.config.limits.max_text_chars
        if utt.text_chars > limit:
            message = f"text too long: more than {limit} characters ([limits] max_text_chars)"
            await self._fail(utt, "text_too_long", message)
            return
        if utt.stream.opened:
            utt.stream.push(text, end)
        else:
            utt.pending.append(text)  # `_pump` pushes it, with its end if the input has ended
        if end:
            utt.input_ended = True

    def _input_utterance(self) -> _Utterance | None:
        last = self._utterances[-1] if self._utterances else None
        return last if last is not None and not last.input_ended else None

    def _new_utterance(self) -> _Utterance:
        s = self.settings
        stream = SpeechStream(
            self.engine,
            voice=s.voice,
            options=s.options,
            sample_rate_hz=s.sample_rate,
            trim_leading_ms=self.config.webrtc.trim_leading_silence_ms,
        )
        utt = _Utterance(stream, s.binary)
        self._utterances.append(utt)
        self._added.set()
        return utt

    def _flush(self) -> None:
        utt = self._input_utterance()
        if utt is None:
            return
        utt.input_ended = True
        if utt.stream.opened:
            utt.stream.end_input()

    def _cancel_all(self) -> list[_Utterance]:
        """Every utterance of the session stops now; returns those not reported yet (now marked)."""
        victims = list(self._utterances)
        self._utterances.clear()
        self._open = None
        unreported = [utt for utt in victims if not utt.reported]
        for utt in victims:
            utt.stream.cancel()
            utt.reported = True
            utt.opened.set()
        return unreported

    # --- engine ------------------------------------------------------------------------------------

    def _pump(self) -> None:
        """Open the next utterance when none of this session is open in the engine."""
        if self._open is not None and self._open.stream.outcome is None and not self._open.stream.cancelled:
            return
        self._open = None
        for utt in self._utterances:
            if utt.stream.opened or utt.reported:
                continue
            try:
                utt.stream.open()
            except VoiceRTCError as exc:
                refused = open_error(exc)
                self._post_fail(utt, refused.code, refused.message)
                continue
            self._open = utt
            if utt.pending:  # what came while queued, as one text (whole if its input ended)
                utt.stream.push("".join(utt.pending), utt.input_ended)
            elif utt.input_ended:
                utt.stream.end_input()
            utt.pending.clear()
            utt.opened.set()
            task = self._loop.create_task(self._pump_after(utt))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return

    async def _pump_after(self, utt: _Utterance) -> None:
        await utt.stream.terminal.wait()
        if self._open is utt:
            self._open = None
            self._pump()

    # --- server -> client -------------------------------------------------------------------------

    async def _send_loop(self) -> None:
        while True:
            if not self._utterances:
                self._added.clear()
                await self._added.wait()
                continue
            utt = self._utterances[0]
            await utt.opened.wait()
            if not utt.reported and utt.stream.opened:
                await self._send_utterance(utt)
            if self._utterances and self._utterances[0] is utt:
                self._utterances.popleft()

    async def _send_utterance(self, utt: _Utterance) -> None:
        stream = utt.stream
        frame_bytes = 2 * stream.sample_rate_hz * FRAME_MS // 1000
        started = False
        async for pcm in stream.chunks():
            if not started:
                started = True
                since_s = max(utt.first_text_s or self._loop.time(), self._last_sent_s)
                ttfa_ms = round(1000.0 * max(0.0, self._loop.time() - since_s), 1)
                await self._send(
                    {"type": "speech.started", "utterance_id": utt.utterance_id, "ttfa_ms": ttfa_ms}
                )
            await self._send_marks(utt)
            for start in range(0, len(pcm), frame_bytes):
                if stream.cancelled or self.ws.closed:
                    return
                await self._send_audio(utt, pcm[start : start + frame_bytes])
        self._last_sent_s = self._loop.time()
        if utt.reported or stream.cancelled:
            return
        await self._send_marks(utt)
        utt.reported = True
        if isinstance(stream.outcome, Failed):
            await self._send(_error(utt, stream.outcome.code, stream.outcome.message))
        else:
            await self._send(_done(utt, interrupted=False))

    async def _send_marks(self, utt: _Utterance) -> None:
        for mark in utt.stream.take_marks():
            await self._send(
                {
                    "type": "speech.mark",
                    "utterance_id": utt.utterance_id,
                    "text": mark.text,
                    "audio_ms": round(mark.audio_ms, 1),
                }
            )

    async def _send_audio(self, utt: _Utterance, pcm: bytes) -> None:
        with contextlib.suppress(ConnectionResetError):
            if utt.binary:
                await self.ws.send_bytes(pcm)
            else:
                audio = base64.b64encode(pcm).decode()
                await self.ws.send_json(
                    {"type": "speech.audio.delta", "utterance_id": utt.utterance_id, "audio": audio}
                )

    async def _fail(self, utt: _Utterance, code: str, message: str) -> None:
        utt.stream.cancel()
        utt.input_ended = True
        utt.opened.set()
        if not utt.reported:
            utt.reported = True
            await self._send(_error(utt, code, message))
        if self._open is utt:
            self._open = None
        self._pump()

    def _post_fail(self, utt: _Utterance, code: str, message: str) -> None:
        utt.stream.cancel()
        utt.opened.set()
        if not utt.reported:
            utt.reported = True
            self._post(_error(utt, code, message))

    def _post(self, event: dict[str, Any]) -> None:
        """Send from synchronous code (the pump); the task is kept until it is done."""
        task = self._loop.create_task(self._send(event))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, event: dict[str, Any]) -> None:
        if self.ws.closed:
            return
        with contextlib.suppress(ConnectionResetError):
            await self.ws.send_json(event)


def _done(utt: _Utterance, interrupted: bool) -> dict[str, Any]:
    return {
        "type": "speech.done",
        "utterance_id": utt.utterance_id,
        "audio_ms": round(utt.stream.audio_ms, 1),
        "interrupted": interrupted,
    }


def _error(utt: _Utterance, code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "utterance_id": utt.utterance_id, "code": code, "message": message}
