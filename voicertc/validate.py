"""Checks on text, JSON and speak requests at the edges (HTTP, data channel, NDJSON lines, `AgentCall.say`).

Bad input is refused once, where it enters, with a typed error (`BadTextError`, `BadJsonError`), so
nothing downstream (normalisation, phonemisation, the engine thread) ever sees it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from voicertc.errors import InputError, UnknownVoiceError

# Control characters other than tab, newline and carriage return; lone surrogates; the BMP's
# noncharacters. Also the OpenAPI `pattern` of speakable text (signaling.openapi).
UNSPEAKABLE_RANGES = r"\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufdd0-\ufdef\ufffe\uffff"
_UNSPEAKABLE = re.compile(f"[{UNSPEAKABLE_RANGES}]")
MAX_JSON_DEPTH = 32  # the API's bodies are flat objects; deeper nesting is refused before parsing
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


class BadTextError(InputError):
    """Text the engine cannot speak: NUL and other control characters, lone surrogates, noncharacters."""

    code = "bad_text"
    status = 400


class BadJsonError(InputError):
    """A body or message that is not JSON (undecodable, malformed, nested too deeply)."""

    code = "bad_json"


def check_text(text: str, what: str = "text") -> None:
    """Raise BadTextError naming the first unspeakable character of `text` and where it is."""
    if match := _UNSPEAKABLE.search(text):
        raise BadTextError(
            f"{what} has an unspeakable character U+{ord(match.group()):04X} at index {match.start()}"
        )


def json_depth(raw: bytes) -> int:
    """Nesting depth of the arrays/objects in `raw` (string contents ignored); cheap on big bodies."""
    skeleton = _JSON_STRING.sub(b'""', raw)
    codes = np.frombuffer(skeleton, dtype=np.uint8)
    opens = (codes == ord("[")) | (codes == ord("{"))
    closes = (codes == ord("]")) | (codes == ord("}"))
    steps = opens.astype(np.int64) - closes.astype(np.int64)
    return int(np.cumsum(steps).max(initial=0))


def parse_json(raw: bytes | str, what: str = "body") -> Any:
    """`json.loads` for untrusted input: strict UTF-8, bounded depth; only ever raises BadJsonError."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if json_depth(data) > MAX_JSON_DEPTH:
        raise BadJsonError(f"{what} nests arrays/objects deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BadJsonError(f"{what} is not UTF-8 (byte {exc.start})") from None
    except (ValueError, RecursionError) as exc:
        raise BadJsonError(f"{what} is not valid JSON: {exc}") from None


# --- one speak request ----------------------------------------------------------------------------

MIN_SPEED, MAX_SPEED = 0.5, 2.0


class SpeakRequestError(InputError):
    """A speak request that cannot be queued; `status` is its HTTP status (one code per problem)."""

    code = "bad_input"
    status = 400


class BadFieldError(SpeakRequestError):
    """A field of the wrong type (`voice` not a non-empty string, `interrupt` not a boolean)."""

    code = "bad_request"


class TextTooLongError(SpeakRequestError):
    code = "text_too_long"
    status = 413


class UnknownSpeakVoiceError(SpeakRequestError, UnknownVoiceError):
    code = "unknown_voice"


class OptionNotSupportedError(SpeakRequestError):
    code = "not_supported"


class SpeedNotSupportedError(SpeakRequestError):
    code = "speed_not_supported"


@dataclass(frozen=True)
class SpeakRules:
    """What a speak request is checked against: the text limit and what the engine has and honours."""

    max_text_chars: int
    voices: Collection[str] | None = None  # the engine's voice ids (None: not checked here)
    features: Collection[str] = ()  # speak options the engine honours ("instruct", "speed")


@dataclass(frozen=True)
class SpeakRequest:
    """A checked speak request (HTTP JSON, NDJSON, the data channel, `AgentCall.say`).

    `text` is None when the text streams in (NDJSON lines, an async iterable of deltas): each delta is
    then checked as it arrives (`check_text`, the running total against the same limit)."""

    text: str | None
    voice: str | None = None  # None = the call's / engine's default
    interrupt: bool = False
    instruct: str = ""
    speed: float = 1.0

    @classmethod
    def parse(cls, fields: Mapping[str, Any], rules: SpeakRules, *, streamed: bool = False) -> SpeakRequest:
        """Check every field once; raise the SpeakRequestError of the first problem (its code, status)."""
        with _at("text"):
            text = None if streamed else _speak_text(fields.get("text"), rules.max_text_chars)
        with _at("voice"):
            voice = _speak_voice(fields.get("voice"), rules.voices)
        interrupt = fields.get("interrupt", False)
        if not isinstance(interrupt, bool):
            error = BadFieldError('"interrupt" must be true or false')
            error.field = "interrupt"
            raise error
        with _at("instruct"):
            instruct = _speak_instruct(fields.get("instruct"), rules.features)
        with _at("speed"):
            speed = _speak_speed(fields.get("speed"), rules.features)
        return cls(text=text, voice=voice, interrupt=interrupt, instruct=instruct, speed=speed)


@contextmanager
def _at(field: str) -> Iterator[None]:
    """Name the field an error raised inside is about (`exc.field`: OpenAI's `param`, logs)."""
    try:
        yield
    except InputError as exc:
        exc.field = field
        raise


def _speak_text(text: object, max_chars: int) -> str:
    if not isinstance(text, str) or not text.strip():
        raise SpeakRequestError('"text" must be a non-empty string')
    if len(text) > max_chars:
        raise TextTooLongError(f"text has {len(text)} characters; the limit is {max_chars}")
    check_text(text)
    return text


def _speak_voice(voice: object, known: Collection[str] | None) -> str | None:
    if voice is None:
        return None
    if not isinstance(voice, str) or not voice:
        raise BadFieldError('"voice" must be a non-empty string (a voice id) or absent')
    if known is not None and voice not in known:
        raise UnknownSpeakVoiceError(f"unknown voice {voice!r}; available: {', '.join(known) or 'none'}")
    return voice


def _speak_instruct(instruct: object, features: Collection[str]) -> str:
    if instruct is None:
        return ""
    if not isinstance(instruct, str):
        raise SpeakRequestError('"instruct" must be a string')
    instruct = instruct.strip()
    if instruct:
        check_text(instruct, "instruct")
        if "instruct" not in features:
            raise OptionNotSupportedError("instruct is not supported by this engine (CosyVoice only)")
    return instruct


def _speak_speed(speed: object, features: Collection[str]) -> float:
    """`speed` follows the reference: applied only in non-streaming synthesis (cosyvoice.md §6.2); an
    engine that cannot synthesize without streaming refuses any value but 1.0."""
    if speed is None:
        return 1.0
    if isinstance(speed, bool) or not isinstance(speed, int | float) or speed != speed:
        raise SpeakRequestError('"speed" must be a number')
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise SpeakRequestError(f'"speed" must be {MIN_SPEED:g}..{MAX_SPEED:g}')
    if speed != 1.0 and "speed" not in features:
        raise SpeedNotSupportedError(
            "speed is applied only in non-streaming synthesis (as in the reference), which this engine "
            "does not do: only speed 1.0 is accepted"
        )
    return float(speed)
