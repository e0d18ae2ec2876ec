"""The /v1/calls endpoints (WHIP-shaped signaling, speak, interrupt, server-sent events).

Handlers run on the event loop; they validate at the edge (4xx JSON naming the problem) and hand
everything else to `CallRegistry` / `Call`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from signaling.auth import principal
from signaling.errors import ApiError
from signaling.registry import CallRegistry
from signaling.sdp import check_not_restart, check_offer, parse_sdpfrag
from voicertc.errors import EngineStoppedError, EngineUnavailableError, InputError, VoiceRTCError
from voicertc.validate import (
    BadJsonError,
    BadTextError,
    SpeakRequest,
    SpeakRequestError,
    check_text,
    parse_json,
)
from voicertc.webrtc.call import Call
from voicertc.webrtc.speech import QueueFullError, SpeechHandle, speak_rules

logger = logging.getLogger(__name__)

REGISTRY = web.AppKey("registry", CallRegistry)
SSE_KEEPALIVE_S = 15.0
SSE_MAX_BEHIND = 256  # events an SSE client may lag before it is dropped (it reconnects)
NDJSON_BYTES_PER_CHAR = 16  # generous: JSON escapes (\u, surrogate pairs) plus framing, per character
NDJSON_SLACK_BYTES = 64 * 1024
NDJSON_SLACK_LINES = 1000  # lines allowed beyond one per text character
TOO_LARGE_WHY = "the caps scale with limits.max_text_chars"
DISCARD_IDLE_S = 1.0  # after a stream's utterance ended: stop reading a client this quiet
NDJSON = "application/x-ndjson"
SDPFRAG = "application/trickle-ice-sdpfrag"

routes = web.RouteTableDef()


def _registry(request: web.Request) -> CallRegistry:
    return request.app[REGISTRY]


def _call(request: web.Request) -> Call:
    return _registry(request).get(request.match_info["call_id"], principal(request))


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        data = parse_json(await request.read(), "request body")
    except BadJsonError as exc:
        raise ApiError(400, exc.code, str(exc)) from None
    if not isinstance(data, dict):
        raise ApiError(400, "bad_json", "request body must be a JSON object")
    return data


async def _text_body(request: web.Request, what: str) -> str:
    """The body as UTF-8 text (SDP is UTF-8 whatever charset the request claims): 400 when it is not."""
    raw = await request.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, "bad_encoding", f"{what} is not UTF-8 (byte {exc.start})") from None


def _query_bool(request: web.Request, name: str) -> bool:
    value = request.query.get(name, "false").lower()
    if value not in _BOOLEANS:
        raise ApiError(400, "bad_request", f"query parameter {name!r} must be true or false")
    return _BOOLEANS[value]


_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


def _voice(value: Any, what: str = '"voice"') -> str | None:
    """A voice id: absent/null means the default; anything else must be a non-empty string."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ApiError(400, "bad_request", f"{what} must be a non-empty string (a voice id) or absent")
    return value


def _unsupported(request: web.Request, accepted: str) -> ApiError:
    got = request.content_type or "none"
    return ApiError(415, "unsupported_media_type", f"Content-Type {got!r} not accepted here; use {accepted}")


@routes.post("/v1/calls")
async def create_call(request: web.Request) -> web.Response:
    if request.content_type == "application/sdp":
        offer, voice, as_json = await _text_body(request, "SDP offer"), None, False
    elif request.content_type == "application/json":
        body = await _json_body(request)
        sdp, voice, as_json = body.get("sdp"), body.get("voice"), True
        if body.get("type") != "offer":
            raise ApiError(400, "bad_sdp", 'JSON body needs "type": "offer"')
        if not isinstance(sdp, str):
            raise ApiError(400, "bad_sdp", 'JSON body needs "sdp": the offer as a string')
        offer, voice = sdp, _voice(voice)
    else:
        raise _unsupported(request, "application/sdp or application/json")
    check_offer(offer)
    call, answer = await _registry(request).create(
        offer, voice, owner=principal(request), client=request.remote or ""
    )
    # Behind a load balancer the call lives on this front-end: later requests must reach it here.
    location = f"{call.config.server.public_url.rstrip('/')}/v1/calls/{call.call_id}"
    headers = {"Location": location}
    if call.ignored_media:  # e.g. video: answered inactive, audio only
        headers["X-Ignored-Media"] = ", ".join(call.ignored_media)
    if as_json:
        body = {"id": call.call_id, "sdp": answer, "type": "answer"}
        if call.ignored_media:
            body["ignored_media"] = list(call.ignored_media)
        return web.json_response(body, status=201, headers=headers)
    return web.Response(status=201, text=answer, content_type="application/sdp", headers=headers)


@routes.get("/v1/calls/{call_id}")
async def get_call(request: web.Request) -> web.Response:
    return web.json_response(_call(request).info())


@routes.patch("/v1/calls/{call_id}")
async def trickle(request: web.Request) -> web.Response:
    call = _call(request)
    if request.content_type != SDPFRAG:
        raise _unsupported(request, SDPFRAG)
    if request.headers.get("If-Match") == "*":
        raise ApiError(422, "ice_restart_unsupported", "ICE restart is not supported: start a new call")
    body = await _text_body(request, "SDP fragment")
    if not body.strip():
        raise ApiError(400, "bad_sdpfrag", "empty SDP fragment: send candidates or a=end-of-candidates")
    frag = parse_sdpfrag(body)
    check_not_restart(frag, call.remote_ice)
    await call.add_remote_candidates(frag.candidates, end=frag.end)
    return web.Response(status=204)


@routes.delete("/v1/calls/{call_id}")
async def hang_up(request: web.Request) -> web.Response:
    call = _call(request)
    await call.close("hung up")
    return web.json_response({"id": call.call_id, "state": "closed"})


@routes.post("/v1/calls/{call_id}/speak")
async def speak(request: web.Request) -> web.Response:
    """The request is checked whole (query, body, text: `SpeakRequest.parse`) before the call is looked
    up: what a bad request gets does not depend on whether the call exists."""
    fields: dict[str, Any] = {"interrupt": _query_bool(request, "interrupt")}
    if "voice" in request.query:  # checked even when a JSON body's voice wins: bad input is refused
        _registry(request).check_voice(request.query["voice"], principal(request))
        fields["voice"] = request.query["voice"]
    if request.content_type == NDJSON:
        return await _speak_stream(request, fields)
    if request.content_type != "application/json":
        raise _unsupported(request, f"application/json or {NDJSON}")
    body = await _json_body(request)
    speak_request = _parse_speak({**fields, **body}, request)
    handle = _speak(_call(request), speak_request)
    return web.json_response({"utterance_id": handle.utterance_id}, status=202)


def _parse_speak(fields: dict[str, Any], request: web.Request, streamed: bool = False) -> SpeakRequest:
    """`SpeakRequest.parse` against this engine and the voices the caller may use (another token's
    registered voice is as unknown as a missing one)."""
    registry = _registry(request)
    rules = speak_rules(registry.engine, registry.config.limits, registry.voices_for(principal(request)))
    try:
        return SpeakRequest.parse(fields, rules, streamed=streamed)
    except (SpeakRequestError, BadTextError) as exc:
        raise ApiError(exc.status, exc.code, str(exc)) from None


def _speak(call: Call, speak_request: SpeakRequest, deltas: AsyncIterator[str] | None = None) -> SpeechHandle:
    """Queue a checked request; what the queue or the engine refuses maps to its HTTP status."""
    try:
        return call.speak_request(speak_request, deltas)
    except QueueFullError as exc:
        raise ApiError(429, exc.code, str(exc), {"Retry-After": "1"}) from exc
    except EngineUnavailableError as exc:  # a remote engine out of reach (or loading) says when to retry
        raise ApiError(503, exc.code, str(exc), {"Retry-After": str(exc.retry_after_s)}) from exc
    except EngineStoppedError as exc:
        raise ApiError(503, exc.code, str(exc)) from exc
    except VoiceRTCError as exc:
        raise ApiError(400, exc.code, str(exc)) from exc


class _NdjsonError(InputError):
    """A broken NDJSON stream: fails its utterance (error event) with `code`, the call stays up."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


async def _ndjson_lines(request: web.Request, max_bytes: int, max_lines: int) -> AsyncIterator[bytes]:
    """The body's lines as they arrive, blank ones included, never holding more than `max_bytes`:
    the byte and line caps bound a stream whose lines carry no text (blank, `{"text": ""}`)."""
    pending = b""
    body_bytes = 0
    line_no = 0
    while chunk := await request.content.readany():
        body_bytes += len(chunk)
        if body_bytes > max_bytes:
            raise _NdjsonError("ndjson_too_large", f"stream passed {max_bytes} bytes ({TOO_LARGE_WHY})")
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            line_no += 1
            if line_no > max_lines:
                raise _NdjsonError("ndjson_too_large", f"stream passed {max_lines} lines ({TOO_LARGE_WHY})")
            yield line
    if pending.strip():
        yield pending


async def _ndjson_deltas(request: web.Request, limit: int) -> AsyncIterator[str]:
    """Text deltas from `{"text": ...}` lines, yielded as they arrive."""
    total = 0
    max_bytes = NDJSON_BYTES_PER_CHAR * limit + NDJSON_SLACK_BYTES
    lines = _ndjson_lines(request, max_bytes, limit + NDJSON_SLACK_LINES)
    line_no = 0
    async for raw in lines:
        line_no += 1
        if not raw.strip():
            continue
        try:
            item = parse_json(raw, f"line {line_no}")
        except BadJsonError as exc:
            raise _NdjsonError("bad_ndjson", str(exc)) from None
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            raise _NdjsonError("bad_ndjson", f'line {line_no} must be an object with a string "text"')
        try:
            check_text(item["text"], f"line {line_no}")
        except BadTextError as exc:
            raise _NdjsonError(exc.code, str(exc)) from None
        total += len(item["text"])
        if total > limit:
            raise _NdjsonError("text_too_long", f"streamed text passed the limit of {limit} characters")
        yield item["text"]


STREAM_ERRORS = {
    "bad_ndjson": 400,
    "bad_text": 400,
    "text_too_long": 413,
    "ndjson_too_large": 413,
    "text_idle_timeout": 408,
}


async def _speak_stream(request: web.Request, fields: dict[str, Any]) -> web.Response:
    """Stream NDJSON deltas into one utterance; answer when the body ends (202) or breaks (4xx).

    The utterance id is known at once: it goes out as `speech.queued` on the data channel and SSE.
    """
    if "instruct" in request.query:
        fields["instruct"] = request.query["instruct"]
    if "speed" in request.query:
        try:
            fields["speed"] = float(request.query["speed"])
        except ValueError:
            raise ApiError(400, "bad_request", "?speed= must be a number") from None
    speak_request = _parse_speak(fields, request, streamed=True)
    call = _call(request)
    limits = call.config.limits
    handle = _speak(call, speak_request, _ndjson_deltas(request, limits.max_text_chars))
    assert handle.feeder is not None
    await asyncio.wait([handle.feeder])
    await _discard_rest(request, call)
    event = handle.terminal.result() if handle.finished else None
    if event is not None and event["type"] == "error" and event["code"] in STREAM_ERRORS:
        status = STREAM_ERRORS[event["code"]]
        raise ApiError(status, event["code"], f"utterance {handle.utterance_id}: {event['message']}")
    return web.json_response({"utterance_id": handle.utterance_id}, status=202)


async def _discard_rest(request: web.Request, call: Call) -> None:
    """Read and drop what an interrupted or failed stream still sends (so the connection stays
    usable), but never past the call's end, a client silent for DISCARD_IDLE_S, or NDJSON_SLACK_BYTES."""
    dropped = 0
    while not call.closed.is_set() and not request.content.at_eof() and dropped < NDJSON_SLACK_BYTES:
        try:
            async with asyncio.timeout(DISCARD_IDLE_S):
                chunk = await request.content.readany()
        except TimeoutError:
            return
        if not chunk:
            return
        dropped += len(chunk)


@routes.post("/v1/calls/{call_id}/interrupt")
async def interrupt(request: web.Request) -> web.Response:
    utterance_id, played_ms = _call(request).interrupt()
    return web.json_response({"utterance_id": utterance_id, "played_ms": round(played_ms, 1)})


@routes.get("/v1/calls/{call_id}/events")
async def events(request: web.Request) -> web.StreamResponse:
    """Server-sent events: the data channel's server -> client events, then `call.closed`."""
    call = _call(request)
    queue = call.subscribe(max_events=SSE_MAX_BEHIND)
    try:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), SSE_KEEPALIVE_S)
            except TimeoutError:
                await response.write(b": keepalive\n\n")
                continue
            if event is not None:
                await response.write(_sse(event))
                continue
            if call.overflowed(queue):
                message = f"this stream fell {SSE_MAX_BEHIND} events behind and was dropped; reconnect"
                await response.write(_sse({"type": "error", "code": "events_overflow", "message": message}))
            else:
                await response.write(_sse({"type": "call.closed", "reason": call.close_reason}))
            break
    except ConnectionResetError:  # the client went away mid-stream: nothing left to tell it
        return response
    finally:
        call.unsubscribe(queue)
    await response.write_eof()
    return response


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
