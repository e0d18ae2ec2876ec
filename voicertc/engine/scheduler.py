"""Which utterance the worker serves next: pure functions over the worker's utterances.

Utterances that share a sink (one call) play in the order they were opened, so only the oldest
open utterance of each sink is a candidate. A candidate is runnable when it can write audio it
already has, finish, or make synthesis progress, and its sink has room (backpressure). Among the
runnable ones, utterances still waiting for their first audio go first (time to first audio is what
a listener notices), oldest first; the rest take turns.
"""

from __future__ import annotations

from collections.abc import Iterable

from voicertc.engine.backend import Backend
from voicertc.engine.utterance import Utterance


def sink_heads(utterances: Iterable[Utterance]) -> list[Utterance]:
    """The oldest open utterance of every sink (`utterances` iterate in open order)."""
    seen: set[int] = set()
    heads = []
    for utt in utterances:
        if id(utt.sink) not in seen:
            seen.add(id(utt.sink))
            heads.append(utt)
    return heads


def is_runnable(utt: Utterance, backend: Backend, now_s: float) -> bool:
    if utt.pending_pcm:
        return utt.sink.has_room()
    if utt.synthesis_done:
        return True
    return utt.sink.has_room() and backend.has_work(utt, now_s)


def pick_next(runnable: list[Utterance]) -> Utterance:
    """First-audio-pending utterances first (oldest first), then the least-served one."""

    def key(utt: Utterance) -> tuple[bool, float]:
        started = utt.first_audio_s is not None
        return (started, float(utt.steps) if started else utt.opened_s)

    return min(runnable, key=key)
