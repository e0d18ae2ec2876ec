"""What /openapi.json says about this server's engine: its voices (an enum per caller) and the speak
options it honours, so that every schema-valid request is one the server accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from voicertc.validate import UNSPEAKABLE_RANGES

# The characters voicertc.validate.check_text refuses, as a regex class body a schema can carry: lone
# surrogates are left out (a surrogate range is not a portable regex: validators on Rust's or ECMA's
# engine refuse the whole pattern, and then check nothing); descriptions name them.
SCHEMA_UNSPEAKABLE = UNSPEAKABLE_RANGES.replace(r"\ud800-\udfff", "")


@dataclass(frozen=True)
class EngineFacts:
    """What the document says about this server's engine: the voices the caller may use (None: any
    string, checked by the server) and the speak options it honours ("instruct", "speed")."""

    voices: tuple[str, ...] | None = None
    features: tuple[str, ...] = ("instruct", "speed")


def voice_schema(facts: EngineFacts) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": ["string", "null"],
        "minLength": 1,
        "description": "A voice id (GET /v1/voices); null = default.",
    }
    if facts.voices is not None:
        schema["enum"] = [*facts.voices, None]
    return schema


def query_voice_schema(facts: EngineFacts) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "minLength": 1}
    if facts.voices is not None:
        schema["enum"] = list(facts.voices)
    return schema


def instruct_schema(facts: EngineFacts) -> dict[str, Any]:
    if "instruct" in facts.features:
        return {"type": ["string", "null"]}
    return {"type": ["string", "null"], "pattern": "^\\s*$", "description": "This engine: blank or null."}


def speed_schema(facts: EngineFacts) -> dict[str, Any]:
    if "speed" in facts.features:
        return {"type": ["number", "null"], "minimum": 0.5, "maximum": 2.0}
    return {"enum": [1, None], "description": "This engine: 1 or null."}
