"""OpenAPI entries of the voice registry (/v1/voices) and /readyz, merged into /openapi.json."""

from __future__ import annotations

import re
from typing import Any

from signaling.openapi_facts import SCHEMA_UNSPEAKABLE
from signaling.voice_routes import FIELD_MAX_CHARS
from voicertc.config import Config
from voicertc.voice_ids import RESERVED

JSON = "application/json"


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _voice(description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": {"$ref": "#/components/schemas/Voice"}}}}


# A text field of the registration: no unspeakable character (voicertc.validate.check_text); it is
# stripped, and a blank one counts as absent.
FIELD_PATTERN = f"^[^{SCHEMA_UNSPEAKABLE}]*$"
_BLANK = f"[^\\S{SCHEMA_UNSPEAKABLE}]*"  # whitespace the field may carry around its value (stripped)
# voicertc.voice_ids.VOICE_ID spelled for any regex engine (no inline flags: each reserved device name's
# letters as [xX] classes), between the whitespace `strip` removes; a blank id counts as absent.
_RESERVED = re.sub("[a-z]", lambda m: f"[{m.group()}{m.group().upper()}]", RESERVED)
ID_FIELD_PATTERN = f"^{_BLANK}(?:(?!{_RESERVED}(?:\\.|{_BLANK}$))[A-Za-z0-9][A-Za-z0-9_.-]{{0,63}})?{_BLANK}$"
CLIP = {
    "type": "string",
    "description": "The prompt clip: an audio file FFmpeg decodes (wav, flac, ogg/opus, mp3, webm) holding "
    "voice_min_s-voice_max_s seconds (limits; CosyVoice2 at least 1 s) of sound, not silence; in JSON the "
    "file as base64 (a `data:` URL too). JSON Schema cannot check a clip: one that breaks this is a 400 "
    "naming the cause (`audio_missing` for none or an empty one, `audio_undecodable`, `audio_too_short`, "
    "`audio_too_long`, `audio_silent`).",
}
TRANSCRIPT = (
    "What the clip says (blank: none, a cross-lingual voice). Also refused (`bad_input`): one longer than "
    "the clip can say, over 50 characters per second of clip (100 are always allowed)."
)
ID = (
    "1-64 of `A-Za-z0-9_.-`, starting with a letter or digit, not a device name (con, nul, com1, ...); "
    "blank: one made from `name`."
)
NAME = "A display name (blank: the id)."


VOICE_ID = {"name": "voice_id", "in": "path", "required": True, "schema": {"type": "string"}}
UNKNOWN_VOICE = _error(
    "No such voice (`unknown_voice`), or another token's: a registered voice belongs to the token that "
    "registered it (admin tokens see all)."
)


def voice_paths(config: Config) -> dict[str, Any]:
    limits = config.limits
    return {
        "/v1/voices": {
            "get": {
                "summary": "Every voice of the engine: spk2info.pt voices, registered voices, Piper's own.",
                "responses": {
                    "200": {
                        "description": "`{voices: [Voice]}`",
                        "content": {
                            JSON: {
                                "schema": {
                                    "type": "object",
                                    "properties": {
                                        "voices": {
                                            "type": "array",
                                            "items": {"$ref": "#/components/schemas/Voice"},
                                        }
                                    },
                                }
                            }
                        },
                    },
                    "503": _error(
                        "The engine is not running (`engine_stopped`), or the Ray engine app does not "
                        "answer (`engine_unavailable`, with `Retry-After`)."
                    ),
                },
            },
            "post": {
                "summary": "Register a zero-shot voice from a clip and its transcript (CosyVoice2).",
                "description": "multipart/form-data with `audio` (the file) and `transcript`, or JSON "
                '`{"audio": "<base64>", "transcript"}`; optional `id` (1-64 of `A-Za-z0-9_.-`; default from '
                "`name`) and `name`. wav, flac, ogg/opus, mp3 (anything FFmpeg decodes), "
                f"{limits.voice_min_s:g}-{limits.voice_max_s:g} s (limits.voice_min_s / voice_max_s), "
                f"at most {limits.voice_max_bytes} bytes (limits.voice_max_bytes). Without a transcript the "
                "voice is cross-lingual: the LLM gets neither prompt text nor prompt speech, the flow gets "
                "the prompt. "
                "The features are computed on the engine thread; the voice is persisted in "
                "`[engine] voices_dir` and usable at once (`voice` on call create and on speak).",
                "requestBody": {
                    "required": True,
                    "content": {
                        "multipart/form-data": {"schema": {"$ref": "#/components/schemas/VoiceForm"}},
                        JSON: {"schema": {"$ref": "#/components/schemas/VoiceJson"}},
                    },
                },
                "responses": {
                    "201": _voice("Registered. `Location: /v1/voices/{id}`."),
                    "400": _error(
                        "Bad clip: `audio_too_short`, `audio_too_long`, `audio_silent`, `audio_undecodable`; "
                        "`audio_missing`, `bad_base64`, `bad_json`, `bad_multipart`; a bad id, a transcript "
                        "over limits.max_text_chars or too long for the clip (`bad_input`), an unspeakable "
                        "character in a field (`bad_text`); "
                        "`not_supported` when the engine cannot register voices (Piper; the fake unless "
                        "`[fake] voice_book`)."
                    ),
                    "409": _error("A voice with that id exists (`voice_exists`)."),
                    "413": _error(
                        "The audio file is larger than limits.voice_max_bytes (`audio_too_large`), or a "
                        f"multipart text field is over {FIELD_MAX_CHARS} characters (`field_too_large`)."
                    ),
                    "429": _error(
                        f"`too_many_voices`: {limits.max_voices} voices are registered (limits.max_voices), "
                        "or "
                        f"this token owns {limits.max_voices_per_token} (limits.max_voices_per_token)."
                    ),
                    "415": _error("Content-Type is neither multipart/form-data nor application/json."),
                    "503": _error("The engine is not running (`engine_stopped`)."),
                },
            },
        },
        "/v1/voices/{voice_id}": {
            "parameters": [VOICE_ID],
            "get": {
                "summary": "One voice.",
                "responses": {"200": _voice("The voice."), "404": UNKNOWN_VOICE},
            },
            "delete": {
                "summary": "Delete a registered voice (and its files in the voices directory).",
                "responses": {
                    "200": {"description": '`{"id", "deleted": true}`'},
                    "400": _error("The engine cannot delete voices (`not_supported`)."),
                    "403": _error(
                        "A registered voice with no owner: only an admin token deletes it (`forbidden`)."
                    ),
                    "404": UNKNOWN_VOICE,
                    "409": _error(
                        "A spk2info.pt voice, or a built-in voice of an engine that registers voices, cannot "
                        "be deleted (`voice_read_only`)."
                    ),
                },
            },
        },
        "/readyz": {
            "get": {
                "summary": "Readiness: the engine has loaded, passed its start checks and warmed up.",
                "responses": {
                    "200": {"description": '`{"status": "ready", "engine"}`'},
                    "503": {
                        "description": '`{"status": "not_ready", "reason", "engine"}`: loading, failed to '
                        "load (the reason names the file), or stopped. `Retry-After: 1`."
                    },
                },
            }
        },
    }


def voice_schemas(config: Config) -> dict[str, Any]:
    string = {"type": "string"}
    form_text = {"type": "string", "pattern": FIELD_PATTERN, "maxLength": FIELD_MAX_CHARS}
    json_text = {"type": ["string", "null"], "pattern": FIELD_PATTERN}
    transcript_chars = config.limits.max_text_chars
    return {
        "Voice": {
            "type": "object",
            "properties": {
                "id": string,
                "name": string,
                "kind": {"enum": ["zero_shot", "cross_lingual", "sft", "builtin"]},
                "transcript": string,
                "prompt_s": {"type": "number"},
                "source": {"enum": ["spk2info", "store", "memory", "engine"]},
                "deletable": {"type": "boolean"},
                "created_at": {"type": ["integer", "null"]},
            },
        },
        # Multipart text parts over FIELD_MAX_CHARS are refused (413) before any other check.
        "VoiceForm": {
            "type": "object",
            "required": ["audio"],
            # other parts are ignored, but a part's name travels in a header: no control characters
            "propertyNames": {"pattern": "^[^\\x00-\\x08\\x0a-\\x1f\\x7f]*$"},
            "properties": {
                "audio": {**CLIP, "format": "binary", "contentMediaType": "application/octet-stream"},
                "transcript": {
                    **form_text,
                    "maxLength": min(transcript_chars, FIELD_MAX_CHARS),
                    "description": TRANSCRIPT,
                },
                "id": {**form_text, "pattern": ID_FIELD_PATTERN, "description": ID},
                "name": {**form_text, "description": NAME},
            },
        },  # fmt: skip
        "VoiceJson": {
            "type": "object",
            "required": ["audio"],
            "properties": {
                "audio": {**CLIP, "format": "byte", "contentEncoding": "base64", "minLength": 1},
                "transcript": {**json_text, "maxLength": transcript_chars, "description": TRANSCRIPT},
                "id": {**json_text, "pattern": ID_FIELD_PATTERN, "description": ID},
                "name": {**json_text, "description": NAME},
            },
        },  # fmt: skip
    }
