"""Voice ids: what a registered voice may be called (a file name in the voices directory, a URL part)."""

from __future__ import annotations

import re

from voicertc.errors import InputError

VOICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_voice_id(voice_id: str) -> str:
    if not isinstance(voice_id, str) or not VOICE_ID.match(voice_id):
        raise InputError(f"bad voice id {voice_id!r}: use 1-64 letters, digits, '_', '-', '.'")
    return voice_id
