"""Checks on text and JSON at the edges (HTTP, data channel, NDJSON lines, `AgentCall.say`).

Bad input is refused once, where it enters, with a typed error (`BadTextError`, `BadJsonError`), so
nothing downstream (normalisation, phonemisation, the engine thread) ever sees it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from voicertc.errors import InputError

# Control characters other than tab, newline and carriage return; lone surrogates; the BMP's
# noncharacters. Also the OpenAPI `pattern` of speakable text (signaling.openapi).
UNSPEAKABLE_RANGES = r"\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufdd0-\ufdef\ufffe\uffff"
_UNSPEAKABLE = re.compile(f"[{UNSPEAKABLE_RANGES}]")
MAX_JSON_DEPTH = 32  # the API's bodies are flat objects; deeper nesting is refused before parsing
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


class BadTextError(InputError):
    """Text the engine cannot speak: NUL and other control characters, lone surrogates, noncharacters."""

    code = "bad_text"


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
