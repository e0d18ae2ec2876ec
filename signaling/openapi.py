"""The HTTP API written down as OpenAPI 3.1, served at /openapi.json (limits filled in from the config)."""

from __future__ import annotations

from typing import Any

from signaling.openapi_facts import (
    SCHEMA_UNSPEAKABLE,
    EngineFacts,
    instruct_schema,
    query_voice_schema,
    speed_schema,
    voice_schema,
)
from signaling.openapi_net import net_schemas, with_net
from signaling.openapi_speech import speech_paths, speech_schemas
from signaling.openapi_voices import voice_paths, voice_schemas
from voicertc.config import Config

JSON = "application/json"


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


CALL_ID = {"name": "call_id", "in": "path", "required": True, "schema": {"type": "string"}}
UNKNOWN = _error("No such call (hung up, timed out, never existed, or another token's call).")
# Speakable text: no control characters but tab/newline/CR, no lone surrogates or BMP noncharacters,
# and something besides whitespace (voicertc.validate.check_text; blank text is `bad_input`).
# Lone surrogates are left out of the pattern: a surrogate range is not a portable regex (validators on
# Rust's or ECMA's engine refuse the whole pattern, and then check nothing); the description names them.
TEXT_PATTERN = f"^[^\\S{SCHEMA_UNSPEAKABLE}]*[^\\s{SCHEMA_UNSPEAKABLE}][^{SCHEMA_UNSPEAKABLE}]*$"
# An SDP offer (RFC 8866) starts with its version line; what makes it usable (an audio m-line, a DTLS
# fingerprint) JSON Schema cannot say, so the format names it (`sdp-offer`) and the 400 lists the causes.
SDP_OFFER = {
    "type": "string",
    "format": "sdp-offer",
    "minLength": 1,
    "description": "An SDP offer (RFC 8866): `v=0` first, an audio m-line, a DTLS fingerprint.",
}
# An RFC 8840 fragment: `a=` lines (candidates with their `a=mid`, or `a=end-of-candidates`).
SDP_FRAGMENT = {"type": "string", "format": "sdp-fragment", "minLength": 1}
# One event of a text/event-stream: `event:` (absent: message) and its `data:` (JSON).
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string", "contentMediaType": JSON}},
}
# A WebSocket route answers a plain GET with 426: the upgrade headers are required parameters.
WS_UPGRADE = [
    {"name": "Upgrade", "in": "header", "required": True, "schema": {"enum": ["websocket"]}},
    {"name": "Connection", "in": "header", "required": True, "schema": {"enum": ["Upgrade"]}},
    {"name": "Sec-WebSocket-Version", "in": "header", "required": True, "schema": {"enum": ["13"]}},
    {
        "name": "Sec-WebSocket-Key",
        "in": "header",
        "required": True,
        "schema": {"type": "string", "pattern": "^[A-Za-z0-9+/]{21}[AQgw]==$"},
        "description": "16 random bytes, base64 (RFC 6455).",
    },
]


def _paths(config: Config, facts: EngineFacts) -> dict[str, Any]:
    limit = config.limits.max_text_chars
    limits = config.limits
    engine_stopped = _error(
        "The engine is not running (`engine_stopped`), or a remote engine is out of reach "
        "(`engine_unavailable`, with `Retry-After`; the call stays up)."
    )
    return {
        "/v1/calls": {
            "post": {
                "summary": "Start a call (WHIP-shaped): send an SDP offer, get the SDP answer.",
                "description": "The offer must have an audio m-line the browser can receive on (recvonly or "
                "sendrecv) and may create a data channel named `events`. The answer carries every server "
                "candidate (no server-side trickle).",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/sdp": {"schema": SDP_OFFER},
                        JSON: {"schema": {"$ref": "#/components/schemas/Offer"}},
                    },
                },
                "responses": {
                    "201": {
                        "description": "Call created. `Location: /v1/calls/{id}` (prefixed with "
                        "`server.public_url` when set: the front-end holding the call). Body: the SDP answer "
                        "(application/sdp) or `{id, sdp, type: answer}` (JSON), matching the request.",
                        "headers": {"Location": {"schema": {"type": "string"}}},
                        "content": {
                            "application/sdp": {"schema": {"type": "string"}},
                            JSON: {"schema": {"$ref": "#/components/schemas/Answer"}},
                        },
                    },
                    "400": _error(
                        "Malformed SDP, a malformed m-line or no usable DTLS fingerprint (`bad_sdp`), no "
                        "receivable audio (`no_audio`), a body that is not UTF-8 (`bad_encoding`), bad JSON "
                        "(`bad_json`), a bad or unknown voice (`bad_request`, `unknown_voice`)."
                    ),
                    "409": _error("The connection failed while the offer was answered (`call_closed`)."),
                    "429": {
                        **_error(
                            f"{limits.max_pending_calls} calls of this token (of this client address without "
                            "auth) have not connected yet (limits.max_pending_calls, "
                            "`too_many_pending_calls`); an answered call must connect within "
                            f"{config.webrtc.pending_timeout_s:g} s (webrtc.pending_timeout_s). Also when "
                            f"{limits.max_pending_total} calls of all clients are pending "
                            "(limits.max_pending_total)."
                        ),
                        "headers": {"Retry-After": {"schema": {"type": "string"}}},
                    },
                    "413": _error("SDP offer larger than 64 KiB (`sdp_too_large`)."),
                    "415": _error("Content-Type is neither application/sdp nor application/json."),
                    "503": _error(
                        f"{config.limits.max_calls} calls are open (limits.max_calls; see `Retry-After`), "
                        "or the engine is not running (`engine_stopped`)."
                    ),
                },
            }
        },
        "/v1/calls/{call_id}": {
            "parameters": [CALL_ID],
            "get": {
                "summary": "Call state and counters.",
                "responses": {
                    "200": _json("The call.", {"$ref": "#/components/schemas/CallInfo"}),
                    "404": UNKNOWN,
                },
            },
            "patch": {
                "summary": "Trickle ICE: remote candidates as an SDP fragment (RFC 8840).",
                "description": "Supported: `a=candidate` lines (with `a=mid`) and `a=end-of-candidates`. "
                "ICE restart (`If-Match: *`, or ICE credentials other than the offer's) is not supported "
                "and answers 422.",
                "requestBody": {
                    "required": True,
                    "content": {"application/trickle-ice-sdpfrag": {"schema": SDP_FRAGMENT}},
                },
                "responses": {
                    "204": {"description": "Candidates added."},
                    "400": _error(
                        "An empty fragment or a line that is not SDP (`bad_sdpfrag`), a candidate that does "
                        "not parse (`bad_candidate`), a body that is not UTF-8 (`bad_encoding`)."
                    ),
                    "404": UNKNOWN,
                    "413": _error("Fragment larger than 64 KiB (`sdp_too_large`)."),
                    "415": _error("Content-Type is not application/trickle-ice-sdpfrag."),
                    "422": _error("ICE restart requested (not supported)."),
                },
            },
            "delete": {
                "summary": "Hang up: the call's engine state, audio buffer and tasks are freed.",
                "responses": {"200": _json("Closed.", {"type": "object"}), "404": UNKNOWN},
            },
        },
        "/v1/calls/{call_id}/speak": {
            "parameters": [CALL_ID],
            "post": {
                "summary": "Speak text into the call; utterances of one call play in order.",
                "description": 'JSON: a whole text. NDJSON (`application/x-ndjson`): one `{"text": delta}` '
                "per line, synthesized as the lines arrive (an LLM stream); `voice` and `interrupt` then go "
                "in the query string; the response comes when the body ends, but the utterance id goes out "
                "at once as `speech.queued` (data channel and SSE). A malformed line fails that utterance "
                "(an `error` event, 400 here); the call stays up. A stream that sends no text for "
                f"{limits.text_idle_timeout_s:g} s (limits.text_idle_timeout_s) fails with 408.",
                "requestBody": {
                    "required": True,
                    "content": {
                        JSON: {"schema": {"$ref": "#/components/schemas/Speak"}},
                        "application/x-ndjson": {"schema": {"type": "string", "format": "speak-ndjson"}},
                    },
                },
                "parameters": [
                    {
                        "name": "voice",
                        "in": "query",
                        "description": "NDJSON: the voice (JSON: the body's `voice` wins).",
                        "schema": query_voice_schema(facts),
                    },
                    {
                        "name": "interrupt",
                        "in": "query",
                        "description": "NDJSON: interrupt first (JSON: the body's `interrupt` wins).",
                        "schema": {"type": "boolean"},
                    },
                ],
                "responses": {
                    "202": _json(
                        "Queued.", {"type": "object", "properties": {"utterance_id": {"type": "string"}}}
                    ),
                    "400": _error(
                        "Blank text (`bad_input`), unspeakable text (`bad_text`: control characters, lone "
                        "surrogates, noncharacters), bad JSON (`bad_json`), a malformed NDJSON line "
                        "(`bad_ndjson`), a bad query value (`bad_request`), an unknown voice."
                    ),
                    "404": UNKNOWN,
                    "408": _error("The NDJSON stream went silent (`text_idle_timeout`)."),
                    "413": _error(
                        f"Text longer than {limit} characters (limits.max_text_chars), or an NDJSON body "
                        "with far more bytes or lines than that (`ndjson_too_large`)."
                    ),
                    "415": _error("Content-Type is neither application/json nor application/x-ndjson."),
                    "429": {
                        **_error(
                            f"{limits.max_queued_utterances} utterances are queued or playing on this call "
                            "(limits.max_queued_utterances, `too_many_utterances`), or the engine has "
                            f"{limits.max_utterances} open (limits.max_utterances, `engine_busy`)."
                        ),
                        "headers": {"Retry-After": {"schema": {"type": "string"}}},
                    },
                    "503": engine_stopped,
                },
            },
        },
        "/v1/calls/{call_id}/interrupt": {
            "parameters": [CALL_ID],
            "post": {
                "summary": "Barge-in: stop the utterance playing (short fade) and drop every queued one.",
                "responses": {
                    "200": _json(
                        "What was cut (utterance_id null when nothing was pending).",
                        {"$ref": "#/components/schemas/Interrupted"},
                    ),
                    "404": UNKNOWN,
                },
            },
        },
        "/v1/calls/{call_id}/events": {
            "parameters": [CALL_ID],
            "get": {
                "summary": "Server-sent events mirroring the `events` data channel, then `call.closed`.",
                "responses": {
                    "200": {
                        "description": "text/event-stream of `event: <type>` / `data: <json>`.",
                        "content": {"text/event-stream": {"schema": SSE_EVENT}},
                    },
                    "404": UNKNOWN,
                },
            },
        },
        "/v1/calls/{call_id}/audio": {
            "parameters": [CALL_ID],
            "get": {
                "parameters": WS_UPGRADE,
                "summary": "WebSocket: the caller's microphone as 16 kHz mono PCM16 (little-endian) binary "
                "frames of 20 ms, for an agent in another process.",
                "description": "Send a WebSocket upgrade. The first message is text JSON `{type: "
                "audio.format, encoding: pcm_s16le, sample_rate_hz: 16000, channels: 1, frame_ms: 20, "
                "call_id}`; then binary frames until the call ends (close code 1000). A reader that stalls "
                "for `[listen] ws_stall_timeout_s` is closed with code 4008 (its dropped audio is counted "
                "in /metrics as voicertc_inbound_dropped_frames_total). Audio starts when the caller's "
                "microphone does (an offer with sendrecv audio).",
                "responses": {
                    "101": {"description": "Switching protocols: the audio stream."},
                    "404": UNKNOWN,
                    "409": _error("Listening is off (`[listen] enabled = false`)."),
                    "426": _error("Not a WebSocket upgrade request."),
                },
            },
        },
        "/healthz": {
            "get": {
                "summary": "Liveness: `{status}` for anyone; with a valid token (or without auth) also the "
                "engine, its voices and the calls the token sees.",
                "responses": {
                    "200": _json("OK.", {"$ref": "#/components/schemas/Health"}),
                    "503": _json("Engine stopped.", {"$ref": "#/components/schemas/Health"}),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus text format: active calls, utterances, TTFA histogram, "
                "underrun frames, interrupts, errors. Behind a token with `[auth] protect_metrics` (an "
                "admin token when `[auth] admin_tokens` is set).",
                "responses": {
                    "200": {
                        "description": "Prometheus text exposition, version 0.0.4.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
    }


def _schemas(config: Config, facts: EngineFacts) -> dict[str, Any]:
    string = {"type": "string"}
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["code", "message"],
                    "properties": {"code": string, "message": string},
                }
            },
        },
        "CallInfo": {
            "type": "object",
            "required": ["id", "state", "pending_utterances", "frames_sent", "underrun_frames", "queued_ms"],
            "properties": {
                "id": string,
                "state": {
                    "type": "string",
                    "description": "RTCPeerConnection state (new, connecting, connected, ...) or closed.",
                },
                "pending_utterances": {"type": "integer", "minimum": 0, "description": "Queued, not played."},
                "frames_sent": {"type": "integer", "minimum": 0, "description": "20 ms audio frames sent."},
                "underrun_frames": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "Frames of a playing utterance not sent on time, whatever the cause: "
                    "silence sent (engine behind) or frames skipped when a stalled loop re-anchored.",
                },
                "late_frames": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "Frames sent more than one frame (20 ms) after their due time.",
                },
                "gaps_over_100ms": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "Pauses of more than 100 ms between two consecutive frames sent.",
                },
                "queued_ms": {"type": "number", "minimum": 0, "description": "Audio buffered, not yet sent."},
                "listening": {"type": "boolean", "description": "The caller's microphone is listened to."},
            },
        },
        "Offer": {
            "type": "object",
            "required": ["sdp", "type"],
            "properties": {
                "sdp": SDP_OFFER,
                "type": {"const": "offer"},
                "voice": voice_schema(facts),
            },
        },
        "Health": {
            "type": "object",
            "required": ["status"],
            "properties": {
                "status": {"enum": ["ok", "engine_stopped"]},
                "engine": string,
                "voices": {"type": "array", "items": string},
                "active_calls": {"type": "integer", "minimum": 0},
            },
        },
        "Answer": {
            "type": "object",
            "properties": {
                "id": string,
                "sdp": string,
                "type": {"const": "answer"},
                "ignored_media": {
                    "type": "array",
                    "items": string,
                    "description": 'Offered media the answer turned down ("video"); absent when none.',
                },
            },
        },
        "Speak": {
            "type": "object",
            "required": ["text"],
            "properties": {
                "text": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": config.limits.max_text_chars,
                    "pattern": TEXT_PATTERN,
                    "description": "Speakable text: not blank; no control characters but tab, newline and "
                    "carriage return; no lone surrogates or noncharacters (else `bad_text`).",
                },
                "voice": voice_schema(facts),
                "interrupt": {"type": "boolean"},
                "instruct": {
                    **instruct_schema(facts),
                    "description": "CosyVoice2 instruct2: an instruction for the voice ('Speak happily.', "
                    "'用四川话说这句话'); `<|endofprompt|>` is appended when absent. The LLM then gets the "
                    "instruction instead of the voice's transcript and no prompt speech; the flow keeps the "
                    "voice. Other engines: 400 `not_supported`. NDJSON: `?instruct=`.",
                },
                "speed": {
                    **speed_schema(facts),
                    "description": "Speaking rate (CosyVoice2), 0.5..2, default 1. NON-STREAMING ONLY, as "
                    "in the reference (cosyvoice.md §6.2): with speed != 1 each text segment is synthesized "
                    "whole (full-attention flow), its mel interpolated to len/speed frames, then vocoded, so "
                    "the first audio comes after the whole segment. Engines without it (Piper, fake): 400 "
                    "`speed_not_supported` unless 1. NDJSON: `?speed=`.",
                },
            },
            "description": "Fine-grained tags in `text` ([laughter], [breath], <strong>...</strong>, "
            "[noise], [cough], [sigh], <laughter>...</laughter>, ...) are CosyVoice2 special tokens, passed "
            "to the "
            "model as single ids. A voice registered without a transcript speaks cross-lingually.",
        },
        "Interrupted": {
            "type": "object",
            "properties": {"utterance_id": {"type": ["string", "null"]}, "played_ms": {"type": "number"}},
        },
        "Event": {
            "description": "Data channel `events` and SSE. Client -> server: {type: speak, text, voice?, "
            "interrupt?, instruct?, speed?}, {type: interrupt}, {type: ping} (keep-alive; answered with "
            "pong). "
            "Server -> client: "
            "speech.queued {utterance_id} (every utterance, however it was requested), speech.started "
            "{utterance_id, ttfa_ms} (not sent for an utterance without audio), speech.done "
            "{utterance_id, played_ms}, speech.interrupted {utterance_id, played_ms, heard_text} "
            "(heard_text: the text of the utterance's chunks whose audio had started playing; barge_in: "
            "speech | words when the caller's voice cut it), error {code, "
            "message, utterance_id?}; from the caller's microphone (two-way calls): user.speech.started "
            "{at_ms}, user.speech.stopped {at_ms, duration_ms}, user.transcript {text, start_ms, end_ms, "
            "dropped?} (dropped: true when Whisper's bounded queue dropped the segment); "
            "SSE ends with call.closed {reason}, or error {code: events_overflow} when the "
            "client fell too far behind.",
            "type": "object",
            "required": ["type"],
            "properties": {"type": string},
        },
    }


def _secured(paths: dict[str, Any], config: Config) -> dict[str, Any]:
    """/v1 operations answer 401/403 under auth; /healthz and /readyz are public; /metrics is guarded
    only with `[auth] protect_metrics`."""
    unauthorized = _error("No bearer token (`unauthorized`; `[auth]` tokens are set).")
    forbidden = _error("A token that is not accepted here (`forbidden`).")
    for path, item in paths.items():
        guarded = path.startswith("/v1/") or (path == "/metrics" and config.auth.protect_metrics)
        for method, operation in item.items():
            if method == "parameters":
                continue
            if guarded:
                operation["responses"].setdefault("401", unauthorized)
                operation["responses"].setdefault("403", forbidden)
                if path == "/metrics":
                    operation["security"] = [{"bearer": []}]
            else:
                operation["security"] = []
    return paths


def openapi_spec(config: Config, facts: EngineFacts | None = None) -> dict[str, Any]:
    """The document for this server; `facts` (the engine's voices and options) make it exact for the
    caller, the default describes any engine."""
    facts = facts or EngineFacts()
    bearer = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "voicertc",
            "version": "0.1.0",
            "description": "Real-time WebRTC text-to-speech calls. With `[auth] tokens` set, every /v1 "
            "request needs `Authorization: Bearer <token>` (401 without, 403 wrong).",
        },
        "paths": _with_body_timeout(
            _secured(
                with_net(
                    {**_paths(config, facts), **voice_paths(config), **speech_paths(config, WS_UPGRADE)},
                    config,
                ),
                config,
            ),
            config,
        ),
        "components": {
            "schemas": {
                **_schemas(config, facts),
                **voice_schemas(config),
                **net_schemas(),
                **speech_schemas(config, TEXT_PATTERN, facts),
            },
            "securitySchemes": bearer,
        },
        "security": [{"bearer": []}] if config.auth.enabled else [],
    }


def _with_body_timeout(paths: dict[str, Any], config: Config) -> dict[str, Any]:
    """Every operation with a request body may answer 408 `body_timeout` (signaling/edges.py)."""
    timeout = _error(
        f"The request body did not arrive within {config.server.body_timeout_s:g} s "
        "(server.body_timeout_s, `body_timeout`); the connection is closed."
    )
    for item in paths.values():
        for operation in item.values():
            if not isinstance(operation, dict) or "requestBody" not in operation:
                continue
            known = operation["responses"].get("408")
            if known is None:
                operation["responses"]["408"] = timeout
            else:
                known["description"] += f" Or: {timeout['description']}"
    return paths
