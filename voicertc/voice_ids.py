"""Voice ids: what a registered voice may be called (a file name in the voices directory, a URL part).

An id is 1-64 of `A-Z a-z 0-9 _ - .`, starting with a letter or digit, so it is never `.`/`..`, never a
hidden file, never holds a path separator and is never a device name Windows reserves (`con`, `nul`,
`com1`, ... with or without an extension). Two ids that differ only in case would share files on a
case-insensitive file system, so a registration refuses an id that `same_file_name` finds taken.
A voice's files are the id plus a suffix (`voice_path(dir, "a.b", ".json")` -> `dir/a.b.json`): never
`Path.with_suffix`, which would read the part after the last dot as a suffix and give `a.b` and `a.c`
the same files.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Collection
from pathlib import Path

from voicertc.errors import InputError

# Device names Windows reserves whatever the extension ("nul.json" is the null device there).
RESERVED = r"(?:con|prn|aux|nul|com[0-9]|lpt[0-9])"
VOICE_ID = re.compile(rf"^(?!(?i:{RESERVED})(?:\.|$))[A-Za-z0-9][A-Za-z0-9_.-]{{0,63}}$")


def check_voice_id(voice_id: str) -> str:
    if not isinstance(voice_id, str) or not VOICE_ID.match(voice_id):
        raise InputError(
            f"bad voice id {voice_id!r}: use 1-64 letters, digits, '_', '-', '.', starting with a letter or "
            "digit, and not a device name (con, nul, com1, ...)"
        )
    return voice_id


def free_voice_id(name: str, taken: Collection[str]) -> str:
    """An id for a voice registered without one: from its name (`voice` for a blank one), with a random
    suffix when that is taken or not a valid id."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", name.strip().lower()).strip("-._")[:48] or "voice"
    if stem not in taken and VOICE_ID.match(stem):
        return stem
    return f"{stem}-{uuid.uuid4().hex[:6]}"


def same_file_name(a: str, b: str) -> bool:
    """Ids a case-insensitive file system (macOS, Windows) would store in the same files."""
    return a != b and a.casefold() == b.casefold()


def voice_path(directory: str | Path, voice_id: str, suffix: str) -> Path:
    """The file of `voice_id` with this suffix (".json", ".safetensors"): the whole id, then the suffix."""
    return Path(directory) / f"{check_voice_id(voice_id)}{suffix}"


def voice_id_of(path: Path, suffix: str) -> str | None:
    """The voice id a file of `voice_path` names; None for any other file (a temp file, a stray name)."""
    name = path.name
    if not name.endswith(suffix):
        return None
    voice_id = name[: -len(suffix)]
    return voice_id if VOICE_ID.match(voice_id) else None
