"""Barge-in policy: when the caller's voice should cut the agent's utterance. Pure, injected clock.

"off": never. "speech": when a speech onset is confirmed (`min_speech_ms` voiced) while the agent is
playing. "words": only when the transcript of the caller's segment (partial or final) holds a word
that is not a backchannel ("mhm", "yeah", "okay", ...), so agreement noises never cut the voice.
At most one barge-in per speech segment.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

_WORD = re.compile(r"[a-z0-9']+")


def _normalize(text: str) -> str:
    return " ".join(_WORD.findall(text.lower().replace("-", " ")))


def has_content_word(text: str, backchannels: Iterable[str]) -> bool:
    """Whether `text` holds any word outside the backchannel phrases ("uh-huh" matches "uh huh")."""
    words = _normalize(text)
    if not words:
        return False
    phrases = sorted({_normalize(b) for b in backchannels if _normalize(b)}, key=len, reverse=True)
    padded = f" {words} "
    changed = True
    while changed:
        before = padded
        for phrase in phrases:
            padded = padded.replace(f" {phrase} ", " ")
        changed = padded != before
    return bool(padded.strip())


@dataclass(frozen=True)
class BargeInDecision:
    reason: str  # "speech" | "words"
    segment: int  # the caller's speech segment that caused it
    onset_ms: float  # media time of the segment's onset
    decided_s: float  # clock time of the decision
    text: str = ""  # the transcript that decided it ("words")


class BargeInPolicy:
    """Decides barge-ins for one call. Owned by the event loop.

    `current()` names the agent's utterance now playing or queued (None when the agent is silent), so
    speech while the agent says nothing never cuts anything. A segment barges in at most once, and a
    transcript that arrives after the caller stopped may only cut an utterance that was already
    playing or queued while the caller spoke (never a reply the agent queued after hearing them).
    """

    def __init__(
        self,
        mode: str,
        backchannels: Iterable[str],
        current: Callable[[], str | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in ("off", "speech", "words"):
            raise ValueError(f"barge-in mode must be off, speech or words, got {mode!r}")
        self.mode = mode
        self.backchannels = tuple(backchannels)
        self.current = current
        self.clock = clock
        self.segment = 0  # the current (or last) segment number, 1-based
        self.in_speech = False
        self.onset_ms = 0.0
        self.onset_s: float | None = None  # clock time the segment's onset was confirmed
        self._decided_segment = 0
        self._heard_over: set[str] = set()  # agent utterances current while this segment was spoken
        self.decisions: list[BargeInDecision] = []
        self.ignored_backchannels = 0  # "words": segments whose final transcript was only backchannels

    def speech_started(self, onset_ms: float) -> BargeInDecision | None:
        self.segment += 1
        self.in_speech = True
        self.onset_ms = onset_ms
        self.onset_s = self.clock()
        self._heard_over = set()
        self._note_current()
        if self.mode == "speech":
            return self._decide("speech", "")
        return None

    def speech_stopped(self) -> None:
        self._note_current()
        self.in_speech = False

    def transcript(self, segment: int, text: str, final: bool) -> BargeInDecision | None:
        """A (partial or final) transcript of `segment`; "words" mode may barge in on it."""
        if self.mode != "words":
            return None
        content = has_content_word(text, self.backchannels)
        if final and not content and _normalize(text):
            self.ignored_backchannels += 1
        if segment != self.segment:
            return None
        if self.in_speech:
            self._note_current()
        return self._decide("words", text) if content else None

    def _note_current(self) -> None:
        uid = self.current()
        if uid is not None:
            self._heard_over.add(uid)

    def _decide(self, reason: str, text: str) -> BargeInDecision | None:
        uid = self.current()
        if self._decided_segment == self.segment or uid is None:
            return None
        if not self.in_speech and uid not in self._heard_over:
            return None  # queued after the caller stopped: a reply, not something they talked over
        self._decided_segment = self.segment
        decision = BargeInDecision(reason, self.segment, self.onset_ms, self.clock(), text)
        self.decisions.append(decision)
        return decision
