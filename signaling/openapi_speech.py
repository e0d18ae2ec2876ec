"""OpenAPI entries of POST /v1/audio/speech (OpenAI-compatible) and the /v1/tts/stream WebSocket,
merged into /openapi.json."""

from __future__ import annotations

from typing import Any

from signaling.openapi_facts import EngineFacts, instruct_schema, speed_schema
from signaling.speech_api import OPENAI_VOICES
from voicertc.audio.encode import FORMATS
from voicertc.config import Config

JSON = "application/json"
ERROR = {"$ref": "#/components/schemas/SpeechError"}
# One event of a text/event-stream: its `data:` (JSON) and `event:` (absent: message).
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string", "contentMediaType": JSON}},
}
AUDIO_TYPES = (
    "audio/pcm",
    "audio/wav",
    "audio/ogg",
    "audio/mpeg",
    "audio/flac",
    "audio/aac",
    "text/event-stream",
)


def _error(description: str, retry: bool = False) -> dict[str, Any]:
    response: dict[str, Any] = {"description": description, "content": {JSON: {"schema": ERROR}}}
    if retry:
        response["headers"] = {"Retry-After": {"schema": {"type": "string"}}}
    return response


def speech_paths(config: Config, ws_upgrade: list[dict[str, Any]]) -> dict[str, Any]:
    limits = config.limits
    binary = {"type": "string", "format": "binary"}
    return {
        "/v1/audio/speech": {
            "post": {
                "summary": "OpenAI-compatible speech: the audio of `input`, streamed as it is synthesized.",
                "description": "The response starts when the first audio exists (headers `X-TTFB-Ms`: "
                "request -> first audio, `X-Utterance-Id`, `X-Sample-Rate`: 24000); a client that "
                "disconnects cancels the utterance at once. `pcm` is 24 kHz mono s16le; `wav` has a "
                "streaming header (sizes 0xFFFFFFFF); `opus` is Ogg Opus; `mp3`, `flac`, `aac` (ADTS). "
                '`stream_format: "sse"`: `data:` events `{type: speech.audio.delta, audio: base64}`, then '
                "`{type: speech.audio.done}`. An utterance that fails after its audio started cuts the "
                "connection (a broken stream, never a truncated file that looks whole).",
                "requestBody": {
                    "required": True,
                    "content": {JSON: {"schema": {"$ref": "#/components/schemas/SpeechRequest"}}},
                },
                "responses": {
                    "200": {
                        "description": "The audio (Content-Type per `response_format`), or SSE.",
                        "content": {
                            kind: {"schema": binary} for kind in AUDIO_TYPES if kind != "text/event-stream"
                        }
                        | {"text/event-stream": {"schema": SSE_EVENT}},
                    },
                    "400": _error(
                        "Blank `input` (`bad_input`), unspeakable text (`bad_text`), bad JSON (`bad_json`), "
                        "an unknown voice (`unknown_voice`), a bad field (`bad_request`), `instructions` or "
                        "`speed` the engine cannot honour (`not_supported`, `speed_not_supported`)."
                    ),
                    "413": _error(
                        f"`input` longer than {limits.max_text_chars} characters (`text_too_long`)."
                    ),
                    "415": _error("Content-Type is not application/json."),
                    "429": _error(
                        f"The engine has {limits.max_utterances} open utterances (`engine_busy`).", retry=True
                    ),
                    "500": _error("Synthesis failed before any audio (`synthesis_error`)."),
                    "503": _error(
                        "The engine is not running (`engine_stopped`) or out of reach.", retry=True
                    ),
                },
            }
        },
        "/v1/tts/stream": {
            "get": {
                "parameters": ws_upgrade,
                "summary": "WebSocket: a TTS session that takes text deltas and returns audio as it is made.",
                "description": "Client -> server JSON: `{type: session.update, voice?, format?: pcm_s16le, "
                "sample_rate?: 8000..48000 (24000), instruct?, binary?: true}`, `{type: text.delta, text, "
                "flush?}` (flush true: its last text), "
                "`{type: text.flush}` (speak what is buffered), `{type: cancel}` (stop now, drop queued "
                "text). Server -> client: `session.created` / `session.updated {session}`, "
                "`speech.queued {utterance_id}`, `speech.started {utterance_id, ttfa_ms}`, `speech.mark "
                "{utterance_id, text, audio_ms}` (the engine's text pieces, each before its audio), "
                "binary frames of PCM16 LE mono (at most 40 ms each; or `{type: speech.audio.delta, "
                "utterance_id, audio: base64}` with binary false), then `speech.done {utterance_id, "
                "audio_ms, interrupted}` or `error {utterance_id, code, message}`. Utterances are sent "
                "in order, never interleaved. "
                "At most `[limits] max_queued_utterances` utterances per session (`too_many_utterances`). "
                "A bad message gets `error {code, message}` and the session goes on. Close codes: 1009 "
                f"for a message over the size limit, 4408 after {limits.text_idle_timeout_s:g} s "
                "([limits] text_idle_timeout_s) with no message while nothing is being spoken.",
                "responses": {
                    "101": {"description": "Switching protocols: the session."},
                    "426": _error("Not a WebSocket upgrade request (`upgrade_required`)."),
                },
            }
        },
    }


def _voice(facts: EngineFacts) -> dict[str, Any]:
    """A voice id, OpenAI's names (the default voice) or null; an object `{id}` too."""
    one: dict[str, Any] = {"type": "string", "minLength": 1}
    if facts.voices is not None:
        one["enum"] = sorted({*facts.voices, *OPENAI_VOICES})
    return {
        "anyOf": [one, {"type": "null"}, {"type": "object", "required": ["id"], "properties": {"id": one}}]
    }


def speech_schemas(config: Config, text_pattern: str, facts: EngineFacts) -> dict[str, Any]:
    string = {"type": "string"}
    nullable = {"type": ["string", "null"]}
    return {
        "SpeechRequest": {
            "type": "object",
            "required": ["input"],
            "properties": {
                "model": {**nullable, "description": "Accepted whatever it says: the server has one engine."},
                "input": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": config.limits.max_text_chars,
                    "pattern": text_pattern,
                },
                "voice": {
                    **_voice(facts),
                    "description": "A voice id (GET /v1/voices); OpenAI's names (alloy, ash, coral, echo, "
                    "fable, nova, onyx, sage, shimmer, ...) and null = the default voice.",
                },
                "response_format": {"enum": list(FORMATS), "description": "Default mp3."},
                "speed": {
                    **speed_schema(facts),
                    "description": "As speak's `speed` (CosyVoice2, non-streaming); others 1 only.",
                },
                "instructions": {
                    **instruct_schema(facts),
                    "description": "CosyVoice2 instruct2 (as speak's `instruct`); others blank or null.",
                },
                "stream_format": {"enum": ["audio", "sse"], "description": "Default audio."},
            },
        },
        "SpeechError": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["code", "message"],
                    "properties": {"code": string, "message": string, "type": string, "param": nullable},
                }
            },
        },
    }
