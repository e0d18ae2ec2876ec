"""Who owns a registered voice, and how many voices a token may register. Owned by the event loop.

Voices belong to the token that registered them, as calls do (`signaling/registry.py`): another
non-admin token gets 404 `unknown_voice` for it (GET, DELETE, speaking with it, a call's default
voice), and lists and `available:` hints leave it out, so no voice id leaks across tokens. Admin
tokens see every voice. Voices with no recorded owner (built-in voices, spk2info.pt speakers, voices
registered with auth off or before owners were recorded) are shared: every token may speak with them;
only an admin deletes a shared registered voice.

Owners are kept as digests of tokens (never the token) in `<voices_dir>/.owners.json`, which no voice
id can name (ids never start with a dot), rewritten atomically on each change, so ownership survives
a restart. Caps: `[limits] max_voices` registered voices in all, `max_voices_per_token` per token;
a registration holds its slot from the moment it is accepted until it succeeds or fails, so parallel
requests cannot pass a cap together.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from signaling.auth import Principal
from signaling.errors import ApiError
from voicertc.config import LimitsConfig
from voicertc.voice_ids import VOICE_ID

logger = logging.getLogger(__name__)

OWNERS_FILE = ".owners.json"


class VoiceOwners:
    """voice id -> owner digest, persisted; the caps on registrations."""

    def __init__(self, limits: LimitsConfig, directory: str | Path | None = None) -> None:
        self.max_voices = limits.max_voices
        self.max_per_token = limits.max_voices_per_token
        self.path = Path(directory) / OWNERS_FILE if directory else None
        self._owners: dict[str, str] = self._read()
        self._registering: Counter[str | None] = Counter()  # registrations in flight, by owner

    # --- who may see what -----------------------------------------------------------------------

    def owner(self, voice_id: str) -> str | None:
        return self._owners.get(voice_id)

    def may_use(self, voice_id: str, caller: Principal) -> bool:
        """Speak with it, read it: its owner, an admin, or anyone for a shared voice."""
        owner = self._owners.get(voice_id)
        return owner is None or caller.admin or owner == caller.owner

    def may_delete(self, voice_id: str, caller: Principal) -> bool:
        owner = self._owners.get(voice_id)
        return caller.admin or (owner is not None and owner == caller.owner)

    def visible(self, voice_ids: list[str], caller: Principal) -> list[str]:
        return [v for v in voice_ids if self.may_use(v, caller)]

    # --- registrations ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def registering(self, caller: Principal, registered: int) -> Iterator[None]:
        """Hold a slot for one registration of `caller` while it runs; 429 `too_many_voices` over a cap.
        `registered`: voices registered now (the engine's deletable voices)."""
        in_flight = self._registering.total()
        if registered + in_flight >= self.max_voices:
            raise ApiError(
                429,
                "too_many_voices",
                f"{registered} voices are registered (limits.max_voices = {self.max_voices}); delete one",
            )
        if caller.owner is not None and not caller.admin:
            mine = sum(1 for owner in self._owners.values() if owner == caller.owner)
            if mine + self._registering[caller.owner] >= self.max_per_token:
                raise ApiError(
                    429,
                    "too_many_voices",
                    f"this token owns {mine} voices (limits.max_voices_per_token = {self.max_per_token}); "
                    "delete one first",
                )
        self._registering[caller.owner] += 1
        try:
            yield
        finally:
            self._registering[caller.owner] -= 1
            if self._registering[caller.owner] <= 0:
                del self._registering[caller.owner]

    def record(self, voice_id: str, caller: Principal) -> None:
        """`voice_id` was registered by `caller` (no owner recorded without auth)."""
        if caller.owner is None:
            return
        self._owners[voice_id] = caller.owner
        self._write()

    def forget(self, voice_id: str) -> None:
        if self._owners.pop(voice_id, None) is not None:
            self._write()

    def keep_only(self, voice_ids: set[str]) -> None:
        """Drop owners of voices that no longer exist (deleted over the embedding API, files removed)."""
        gone = [v for v in self._owners if v not in voice_ids]
        for voice_id in gone:
            del self._owners[voice_id]
        if gone:
            self._write()

    # --- the file -----------------------------------------------------------------------------------

    def _read(self) -> dict[str, str]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            logger.error("voice owners file %s unreadable (%s): every stored voice is shared", self.path, exc)
            return {}
        if not isinstance(data, dict):
            return {}
        return {
            k: v for k, v in data.items() if isinstance(k, str) and VOICE_ID.match(k) and isinstance(v, str)
        }

    def _write(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{uuid.uuid4().hex[:6]}.tmp")
            tmp.write_text(json.dumps(self._owners, sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.error("voice owners file %s not written: %s", self.path, exc)
