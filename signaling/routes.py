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

from signaling.errors import ApiError
from signaling.registry import CallRegistry
from signaling.sdp import check_offer, parse_sdpfrag
from voicertc.errors import InputError, VoiceRTCError
from voicertc.webrtc.call import Call
from voicertc.webrtc.speech import SpeechHandle

logger = logging.getLogger(__name__)

REGISTRY = web.AppKey("registry", CallRegistry)
SSE_KEEPALIVE_S = 15.0
NDJSON = "application/x-ndjson"
SDPFRAG = "application/trickle-ice-sdpfrag"

routes = web.RouteTableDef()


def _registry(request: web.Request) -> CallRegistry:
    return request.app[REGISTRY]


def _call(request: web.Request) -> Call:
    return _registry(request).get(request.match_info["call_id"])


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        data = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "bad_json", f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "bad_json", "request body must be a JSON object")
    return data


def _unsupported(request: web.Request, accepted: str) -> ApiError:
    got = request.content_type or "none"
    return ApiError(415, "unsupported_media_type", f"Content-Type {got!r} not accepted here; use {accepted}")


@routes.post("/v1/calls")
async def create_call(request: web.Request) -> web.Response:
    if request.content_type == "application/sdp":
        offer, voice, as_json = await request.text(), None, False
    elif request.content_type == "application/json":
        body = await _json_body(request)
        offer, voice, as_json = body.get("sdp"), body.get("voice"), True
        if body.get("type") != "offer":
            raise ApiError(400, "bad_sdp", 'JSON body needs "type": "offer"')
        if not isinstance(offer, str):
            raise ApiError(400, "bad_sdp", 'JSON body needs "sdp": the offer as a string')
        if voice is not None and not isinstance(voice, str):
            raise ApiError(400, "bad_request", '"voice" must be a string')
    else:
        raise _unsupported(request, "application/sdp or application/json")
    check_offer(offer)
    call, answer = await _registry(request).create(offer, voice)
    location = f"/v1/calls/{call.call_id}"
    headers = {"Location": location}
    if as_json:
        return web.json_response(
            {"id": call.call_id, "sdp": answer, "type": "answer"}, status=201, headers=headers
        )
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
    candidates, _end = parse_sdpfrag(await request.text())
    await call.add_remote_candidates(candidates)
    return web.Response(status=204)


@routes.delete("/v1/calls/{call_id}")
async def hang_up(request: web.Request) -> web.Response:
    call = _call(request)
    await call.close("hung up")
    return web.json_response({"id": call.call_id, "state": "closed"})


@routes.post("/v1/calls/{call_id}/speak")
async def speak(request: web.Request) -> web.Response:
    call = _call(request)
    if request.content_type == NDJSON:
        return await _speak_stream(request, call)
    if request.content_type != "application/json":
        raise _unsupported(request, f"application/json or {NDJSON}")
    body = await _json_body(request)
    text, voice, interrupt = body.get("text"), body.get("voice"), body.get("interrupt", False)
    if not isinstance(text, str) or not text.strip():
        raise ApiError(400, "bad_input", '"text" must be a non-empty string')
    limit = call.config.limits.max_text_chars
    if len(text) > limit:
        raise ApiError(413, "text_too_long", f"text has {len(text)} characters; the limit is {limit}")
    if voice is not None and not isinstance(voice, str):
        raise ApiError(400, "bad_request", '"voice" must be a string')
    if not isinstance(interrupt, bool):
        raise ApiError(400, "bad_request", '"interrupt" must be true or false')
    if voice:
        _registry(request).check_voice(voice)
    handle = _speak(call, text, voice, interrupt)
    return web.json_response({"utterance_id": handle.utterance_id}, status=202)


def _speak(call: Call, text: str | AsyncIterator[str], voice: str | None, interrupt: bool) -> SpeechHandle:
    try:
        return call.speak(text, voice=voice, interrupt=interrupt)
    except VoiceRTCError as exc:
        raise ApiError(400, exc.code, str(exc)) from exc


class _NdjsonError(InputError):
    """A broken NDJSON stream: fails its utterance (error event) with `code`, the call stays up."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


async def _ndjson_deltas(request: web.Request, limit: int) -> AsyncIterator[str]:
    """Text deltas from `{"text": ...}` lines, yielded as they arrive."""
    total = 0
    line_no = 0
    async for raw in request.content:
        line_no += 1
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise _NdjsonError("bad_ndjson", f"line {line_no} is not JSON") from None
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            raise _NdjsonError("bad_ndjson", f'line {line_no} must be an object with a string "text"')
        total += len(item["text"])
        if total > limit:
            raise _NdjsonError("text_too_long", f"streamed text passed the limit of {limit} characters")
        yield item["text"]


async def _speak_stream(request: web.Request, call: Call) -> web.Response:
    """Stream NDJSON deltas into one utterance; answer when the body ends (202) or breaks (400/413)."""
    voice = request.query.get("voice") or None
    interrupt = request.query.get("interrupt", "false").lower() in ("1", "true", "yes")
    if voice:
        _registry(request).check_voice(voice)
    handle = _speak(call, _ndjson_deltas(request, call.config.limits.max_text_chars), voice, interrupt)
    assert handle.feeder is not None
    await asyncio.wait([handle.feeder])
    if not request.content.at_eof():
        await request.read()  # drain what an interrupted or failed stream still sends
    event = handle.terminal.result() if handle.finished else None
    if event is not None and event["type"] == "error" and event["code"] in ("bad_ndjson", "text_too_long"):
        status = 413 if event["code"] == "text_too_long" else 400
        raise ApiError(status, event["code"], f"utterance {handle.utterance_id}: {event['message']}")
    return web.json_response({"utterance_id": handle.utterance_id}, status=202)


@routes.post("/v1/calls/{call_id}/interrupt")
async def interrupt(request: web.Request) -> web.Response:
    utterance_id, played_ms = _call(request).interrupt()
    return web.json_response({"utterance_id": utterance_id, "played_ms": round(played_ms, 1)})


@routes.get("/v1/calls/{call_id}/events")
async def events(request: web.Request) -> web.StreamResponse:
    """Server-sent events: the data channel's server -> client events, then `call.closed`."""
    call = _call(request)
    queue = call.subscribe()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), SSE_KEEPALIVE_S)
            except TimeoutError:
                await response.write(b": keepalive\n\n")
                continue
            if event is None:
                closed = {"type": "call.closed", "reason": call.close_reason}
                await response.write(_sse(closed))
                break
            await response.write(_sse(event))
    except (ConnectionResetError, asyncio.CancelledError):
        call.unsubscribe(queue)
        raise
    call.unsubscribe(queue)
    await response.write_eof()
    return response


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
