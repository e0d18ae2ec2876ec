"""`POST /v1/audio/speech`: OpenAI-compatible speech, streamed as it is synthesized.

Body `{model, input, voice, response_format, speed, instructions, stream_format}`. `model` is accepted
whatever it says (the server has one engine); OpenAI's voice names map to the default voice; `instructions`
is instruct2 (CosyVoice); `speed` follows speak's rules. The response starts when the first audio exists
(its headers carry `X-TTFB-Ms`, request -> first audio, and `X-Utterance-Id`), so an utterance that
fails before any audio still gets an HTTP error. A client that goes away cancels the utterance at once.
Errors carry our `{"code", "message"}` plus the OpenAI envelope fields a client reads (`type`, `param`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from signaling.errors import ApiError
from signaling.routes import REGISTRY
from voicertc.audio.encode import FORMATS, encoder_for
from voicertc.engine.protocol import Cancelled, Engine, Failed, SpeakOptions
from voicertc.errors import EngineStoppedError, EngineUnavailableError, VoiceRTCError
from voicertc.streaming import STREAM_RATE_HZ, SpeechStream
from voicertc.validate import (
    BadJsonError,
    BadTextError,
    SpeakRequest,
    SpeakRequestError,
    SpeakRules,
    parse_json,
)
from voicertc.webrtc.speech import QueueFullError, engine_features, speak_options

logger = logging.getLogger(__name__)

speech_routes = web.RouteTableDef()

# OpenAI's built-in voice names: a client written for OpenAI gets the server's default voice
OPENAI_VOICES = frozenset(
    "alloy ash ballad cedar coral echo fable marin nova onyx sage shimmer verse".split()
)
STREAM_FORMATS = ("audio", "sse")
DISCONNECT_POLL_S = 0.02  # how often a response waiting for audio looks whether its client left
# codes of an utterance that failed on its input (the engine's Failed) -> HTTP status
FAILED_STATUS = {"bad_input": 400, "bad_text": 400, "unknown_voice": 400, "text_too_long": 413}
OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


@dataclass(frozen=True)
class SpeechRequest:
    text: str
    voice: str | None
    response_format: str
    stream_format: str
    options: SpeakOptions


def openai_error(exc: ApiError, param: str | None = None) -> web.Response:
    """Our error body with the fields the OpenAI SDK reads (`type`, `param`) next to `code`/`message`."""
    kind = OPENAI_TYPES.get(exc.status, "server_error" if exc.status >= 500 else "invalid_request_error")
    body = {"error": {"code": exc.code, "message": exc.message, "type": kind, "param": param}}
    return web.json_response(body, status=exc.status, headers=exc.headers)


class _ParamError(ApiError):
    def __init__(self, param: str, message: str, status: int = 400, code: str = "bad_request") -> None:
        super().__init__(status, code, message)
        self.param = param


def map_voice(engine: Engine, voice: object, what: str = '"voice"') -> str | None:
    """Our voice id for `voice`: None (the default) for absent or an OpenAI name we do not have.
    An object `{"id": ...}` (OpenAI's custom voices) names the id. UnknownVoiceError for others."""
    if isinstance(voice, dict):
        voice = voice.get("id")
        if not isinstance(voice, str):
            raise _ParamError("voice", f'{what} as an object needs "id": a voice id')
    if voice is None:
        return None
    if not isinstance(voice, str) or not voice:
        raise _ParamError("voice", f"{what} must be a non-empty string (a voice id) or null")
    if voice in OPENAI_VOICES and voice not in engine.voices():
        return None
    try:
        engine.resolve_voice(voice)
    except VoiceRTCError as exc:
        raise _ParamError("voice", str(exc), code=exc.code) from None
    return voice


def checked_options(engine: Engine, instruct: object, speed: object, instruct_param: str) -> SpeakOptions:
    """instruct / speed through `SpeakRequest.parse` (the speak rules), named as this API names them."""
    try:
        return speak_options(engine, instruct, speed)
    except VoiceRTCError as exc:
        param = instruct_param if exc.field == "instruct" else exc.field or instruct_param
        raise _ParamError(
            param, str(exc).replace('"instruct"', f'"{instruct_param}"'), code=exc.code
        ) from None


def parse_speech_request(body: object, engine: Engine, max_chars: int) -> SpeechRequest:
    """The request checked whole (400/413 naming the field) before anything is queued."""
    if not isinstance(body, dict):
        raise _ParamError("", "request body must be a JSON object", code="bad_json")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _ParamError("model", '"model" must be a string (any: this server has one engine) or null')
    response_format = body.get("response_format", "mp3")
    if not isinstance(response_format, str) or response_format not in FORMATS:
        raise _ParamError(
            "response_format",
            f'"response_format" must be one of {", ".join(FORMATS)}; got {response_format!r}',
        )
    stream_format = body.get("stream_format", "audio")
    if not isinstance(stream_format, str) or stream_format not in STREAM_FORMATS:
        raise _ParamError("stream_format", f'"stream_format" must be "audio" or "sse"; got {stream_format!r}')
    voice = map_voice(engine, body.get("voice"))
    fields = {
        "text": body.get("input"),
        "voice": voice,
        "instruct": body.get("instructions"),
        "speed": body.get("speed"),
    }
    rules = SpeakRules(max_text_chars=max_chars, voices=None, features=engine_features(engine))
    try:
        speak = SpeakRequest.parse(fields, rules)  # the speak rules: one parser for every entry point
    except (SpeakRequestError, BadTextError) as exc:
        param = {"text": "input", "instruct": "instructions"}.get(exc.field, exc.field)
        message = str(exc).replace('"text"', '"input"').replace('"instruct"', '"instructions"')
        raise _ParamError(param, message, exc.status, exc.code) from None
    assert speak.text is not None
    options = SpeakOptions(instruct=speak.instruct, speed=speak.speed)
    return SpeechRequest(speak.text, voice, response_format, stream_format, options)


def open_error(exc: VoiceRTCError) -> ApiError:
    """HTTP status for an utterance the engine refused to open."""
    if isinstance(exc, QueueFullError):
        return ApiError(429, exc.code, str(exc), {"Retry-After": "1"})
    if isinstance(exc, EngineUnavailableError):
        return ApiError(503, exc.code, str(exc), {"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, EngineStoppedError):
        return ApiError(503, exc.code, str(exc))
    return ApiError(400, exc.code, str(exc))


@speech_routes.post("/v1/audio/speech")
async def create_speech(request: web.Request) -> web.StreamResponse:
    registry = request.app[REGISTRY]
    engine = registry.engine
    try:
        if request.content_type != "application/json":
            raise ApiError(
                415, "unsupported_media_type", f"Content-Type {request.content_type!r}: send application/json"
            )
        try:
            body = parse_json(await request.read(), "request body")
        except BadJsonError as exc:
            raise ApiError(400, exc.code, str(exc)) from None
        speech = parse_speech_request(body, engine, registry.config.limits.max_text_chars)
        stream = SpeechStream(
            engine,
            voice=speech.voice,
            options=speech.options,
            sample_rate_hz=STREAM_RATE_HZ,
            trim_leading_ms=registry.config.webrtc.trim_leading_silence_ms,
        )
        try:
            stream.open()
        except VoiceRTCError as exc:
            raise open_error(exc) from None
    except ApiError as exc:
        return openai_error(exc, getattr(exc, "param", None))
    stream.push(speech.text, end=True)
    return await _respond(request, speech, stream)


async def _respond(request: web.Request, speech: SpeechRequest, stream: SpeechStream) -> web.StreamResponse:
    """Send the audio as it comes; cancel the utterance when the client leaves (or anything fails)."""
    loop = asyncio.get_running_loop()
    started_s = loop.time()
    watcher = asyncio.ensure_future(_watch_disconnect(request, stream))
    response: web.StreamResponse | None = None
    encoder = encoder_for(speech.response_format, stream.sample_rate_hz)
    sse = speech.stream_format == "sse"
    try:
        async for pcm in stream.chunks():
            if response is None:
                ttfb_ms = 1000.0 * (loop.time() - started_s)
                response = await _prepare(request, speech, stream, encoder.content_type, ttfb_ms)
            await _write(response, encoder.encode(pcm), sse)
        if response is None:  # no audio at all: an HTTP error says why, or an empty body
            failed = _no_audio_error(stream)
            if failed is not None:
                return openai_error(failed)
            response = await _prepare(request, speech, stream, encoder.content_type, None)
        await _write(response, encoder.finish(), sse)
        if isinstance(stream.outcome, Failed) and stream.outcome.code != "utterance_too_long":
            return _broken(request, response, stream)
        if sse:
            await response.write(_sse_event({"type": "speech.audio.done"}))
        await response.write_eof()
        logger.info(
            "speech %s: %s %.0f ms of audio, ttfb_ms=%s",
            stream.utterance_id,
            speech.response_format,
            stream.audio_ms,
            response.headers.get("X-TTFB-Ms", "-"),
        )
        return response
    except ConnectionResetError:
        stream.cancel()
        logger.info("speech %s: client went away; utterance cancelled", stream.utterance_id)
        if response is None:
            raise
        return response
    except asyncio.CancelledError:  # the server is shutting down
        stream.cancel()
        raise
    finally:
        watcher.cancel()
        stream.cancel()  # no-op once the engine reported its end; frees the engine otherwise


async def _prepare(
    request: web.Request,
    speech: SpeechRequest,
    stream: SpeechStream,
    content_type: str,
    ttfb_ms: float | None,
) -> web.StreamResponse:
    headers = {
        "Content-Type": "text/event-stream" if speech.stream_format == "sse" else content_type,
        "Cache-Control": "no-cache",
        "X-Utterance-Id": stream.utterance_id,
        "X-Sample-Rate": str(stream.sample_rate_hz),
    }
    if ttfb_ms is not None:
        headers["X-TTFB-Ms"] = f"{ttfb_ms:.1f}"
    response = web.StreamResponse(headers=headers)
    response.enable_chunked_encoding()
    await response.prepare(request)
    return response


async def _write(response: web.StreamResponse, data: bytes, sse: bool) -> None:
    if not data:
        return
    if sse:
        data = _sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
    await response.write(data)


def _sse_event(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def _no_audio_error(stream: SpeechStream) -> ApiError | None:
    outcome = stream.outcome
    if isinstance(outcome, Failed):
        status = FAILED_STATUS.get(outcome.code, 500)
        return ApiError(status, outcome.code, f"utterance {stream.utterance_id}: {outcome.message}")
    if isinstance(outcome, Cancelled):
        return ApiError(503, "engine_stopped", "the engine stopped before this utterance finished")
    return None  # Done with no audio (punctuation only): an empty, well-formed body


def _broken(request: web.Request, response: web.StreamResponse, stream: SpeechStream) -> web.StreamResponse:
    """The utterance failed after its audio started: cut the connection, so the client sees a broken
    stream rather than a complete-looking but truncated file."""
    assert isinstance(stream.outcome, Failed)
    logger.warning("speech %s failed mid-stream: %s", stream.utterance_id, stream.outcome.message)
    if request.transport is not None:
        request.transport.close()
    return response


async def _watch_disconnect(request: web.Request, stream: SpeechStream) -> None:
    """aiohttp does not cancel a handler whose client left; a response waiting on the engine looks."""
    with contextlib.suppress(asyncio.CancelledError):
        while stream.outcome is None and not stream.cancelled:
            transport = request.transport
            if transport is None or transport.is_closing():
                logger.info("speech %s: client disconnected; cancelling", stream.utterance_id)
                stream.cancel()
                return
            await asyncio.sleep(DISCONNECT_POLL_S)
