"""The /v1/voices endpoints: list, inspect, register (multipart or JSON + base64) and delete voices.

Handlers run on the event loop and validate at the edge; `VoiceAdmin` decodes off the loop and runs
the backend work as engine commands.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from signaling.auth import principal
from signaling.errors import ApiError
from signaling.voice_admin import NotSupportedError, VoiceAdmin, VoiceInfo
from signaling.voice_owners import VoiceOwners
from voicertc.audio.decode import AudioError
from voicertc.errors import InputError, UnknownVoiceError
from voicertc.validate import BadJsonError, BadTextError, check_text, parse_json
from voicertc.voice_ids import same_file_name

VOICES = web.AppKey("voices", VoiceAdmin)
VOICE_OWNERS = web.AppKey("voice_owners", VoiceOwners)
FIELD_MAX_CHARS = 64 * 1024  # transcript / id / name form fields
BASE64_SLACK_BYTES = 64 * 1024

voice_routes = web.RouteTableDef()


def _admin(request: web.Request) -> VoiceAdmin:
    return request.app[VOICES]


def _owners(request: web.Request) -> VoiceOwners:
    return request.app[VOICE_OWNERS]


def _unknown(voice_id: str) -> ApiError:
    return ApiError(404, "unknown_voice", f"unknown voice {voice_id!r}")


async def _visible_voices(request: web.Request) -> list[VoiceInfo]:
    voices = await _admin(request).list()
    owners = _owners(request)
    owners.keep_only({str(v["id"]) for v in voices})
    caller = principal(request)
    return [v for v in voices if owners.may_use(str(v["id"]), caller)]


async def _registered_count(request: web.Request) -> int:
    return sum(1 for v in await _admin(request).list() if v.get("deletable"))


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413, "audio_too_large", f"the audio file is larger than {limit} bytes (limits.voice_max_bytes)"
    )


async def _read_multipart(request: web.Request, limit: int) -> dict[str, Any]:
    try:
        return await _multipart_fields(request, limit)
    except (ValueError, UnicodeDecodeError, LookupError, HttpProcessingError) as exc:
        # no boundary, a broken part or part header, an unknown charset
        raise ApiError(400, "bad_multipart", f"malformed multipart body: {exc}") from None


async def _multipart_fields(request: web.Request, limit: int) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            raise ApiError(400, "bad_request", "nested multipart bodies are not accepted")
        if part.name == "audio":
            data = bytearray()
            while chunk := await part.read_chunk():
                data += chunk
                if len(data) > limit:
                    raise _too_large(limit)
            fields["audio"] = bytes(data)
        elif part.name in ("transcript", "id", "name"):
            text = await part.text()
            if len(text) > FIELD_MAX_CHARS:
                raise ApiError(413, "field_too_large", f"form field {part.name!r} is too long")
            fields[part.name] = text
        else:
            await part.release()
    return fields


async def _read_json(request: web.Request, limit: int) -> dict[str, Any]:
    body_max = limit * 4 // 3 + BASE64_SLACK_BYTES  # read here, not under the app's client_max_size
    if request.content_length is not None and request.content_length > body_max:
        raise _too_large(limit)
    raw = bytearray()
    while chunk := await request.content.readany():
        raw += chunk
        if len(raw) > body_max:
            raise _too_large(limit)
    try:
        body = parse_json(bytes(raw), "request body")
    except BadJsonError as exc:
        raise ApiError(400, exc.code, str(exc)) from None
    if not isinstance(body, dict):
        raise ApiError(400, "bad_json", "request body must be a JSON object")
    audio = body.get("audio")
    if not isinstance(audio, str) or not audio:
        raise ApiError(400, "bad_request", '"audio" must be the audio file as a base64 string')
    if len(audio) > limit * 4 // 3 + 8:
        raise _too_large(limit)
    try:
        body["audio"] = base64.b64decode(
            audio.split(",", 1)[-1] if audio.startswith("data:") else audio, validate=True
        )
    except (binascii.Error, ValueError) as exc:
        raise ApiError(400, "bad_base64", f'"audio" is not valid base64 ({exc})') from exc
    return body


def _optional_str(fields: dict[str, Any], key: str, max_chars: int | None = None) -> str | None:
    """A text field, stripped (blank: None); `max_chars` counts the field as sent, as the document does."""
    value = fields.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError(400, "bad_request", f'"{key}" must be a string')
    if max_chars is not None and len(value) > max_chars:
        raise ApiError(
            400,
            "bad_input",
            f'"{key}" has {len(value)} characters; the limit is {max_chars} (limits.max_text_chars)',
        )
    try:
        check_text(value, f'"{key}"')
    except BadTextError as exc:
        raise ApiError(400, exc.code, str(exc)) from None
    return value.strip() or None


@voice_routes.post("/v1/voices")
async def register_voice(request: web.Request) -> web.Response:
    caller = principal(request)
    owners = _owners(request)
    with owners.registering(caller, await _registered_count(request)):  # 429 before the body is read
        info = await _register(request)
        owners.record(str(info["id"]), caller)
    return web.json_response(info, status=201, headers={"Location": f"/v1/voices/{info['id']}"})


async def _register(request: web.Request) -> VoiceInfo:
    admin = _admin(request)
    limit = admin.limits.max_bytes
    if request.content_type == "multipart/form-data":
        fields = await _read_multipart(request, limit)
    elif request.content_type == "application/json":
        fields = await _read_json(request, limit)
    elif request.content_type == "application/x-www-form-urlencoded":  # a form without a file part
        try:
            fields = {k: v for k, v in (await request.post()).items() if k != "audio"}
        except (ValueError, UnicodeDecodeError, LookupError) as exc:
            raise ApiError(400, "bad_request", f"malformed form body: {exc}") from None
    else:
        got = request.content_type or "none"
        raise ApiError(
            415,
            "unsupported_media_type",
            f"Content-Type {got!r} not accepted here; use multipart/form-data or application/json",
        )
    audio = fields.get("audio")
    if not isinstance(audio, bytes) or not audio:
        raise ApiError(400, "audio_missing", 'the "audio" field (the clip file) is missing or empty')
    voice_id = _optional_str(fields, "id")
    if voice_id is not None:
        for known in await admin.list():
            if same_file_name(voice_id, str(known["id"])):
                raise ApiError(
                    409, "voice_exists", f"voice {voice_id!r} differs from an existing voice only in case"
                )
    try:
        info = await admin.register(
            audio,
            _optional_str(fields, "transcript", admin.max_transcript_chars),
            voice_id=voice_id,
            name=_optional_str(fields, "name"),
        )
    except AudioError as exc:
        raise ApiError(exc.status, exc.code, str(exc)) from exc
    except NotSupportedError as exc:
        raise ApiError(400, exc.code, str(exc)) from exc
    except InputError as exc:
        status = 409 if exc.code == "voice_exists" else 400
        raise ApiError(status, exc.code, str(exc)) from exc
    return info


@voice_routes.get("/v1/voices")
async def list_voices(request: web.Request) -> web.Response:
    return web.json_response({"voices": await _visible_voices(request)})


@voice_routes.get("/v1/voices/{voice_id}")
async def get_voice(request: web.Request) -> web.Response:
    voice_id = request.match_info["voice_id"]
    for info in await _visible_voices(request):
        if info["id"] == voice_id:
            return web.json_response(info)
    raise _unknown(voice_id)


@voice_routes.delete("/v1/voices/{voice_id}")
async def delete_voice(request: web.Request) -> web.Response:
    voice_id = request.match_info["voice_id"]
    caller, owners = principal(request), _owners(request)
    if not owners.may_use(voice_id, caller):
        raise _unknown(voice_id)  # another token's voice: as unknown as a missing one
    if not owners.may_delete(voice_id, caller):  # a shared voice, a token that is not an admin's
        info = next((v for v in await _admin(request).list() if v["id"] == voice_id), None)
        if info is None:
            raise _unknown(voice_id)
        if info.get("deletable"):  # built-in voices: the engine's own answer below
            raise ApiError(403, "forbidden", f"voice {voice_id!r} has no owner: only an admin deletes it")
    try:
        await _admin(request).delete(voice_id)
    except UnknownVoiceError as exc:
        raise ApiError(404, exc.code, str(exc)) from exc
    except NotSupportedError as exc:
        raise ApiError(400, exc.code, str(exc)) from exc
    except InputError as exc:  # a spk2info voice
        raise ApiError(409, exc.code, str(exc)) from exc
    owners.forget(voice_id)
    return web.json_response({"id": voice_id, "deleted": True})
