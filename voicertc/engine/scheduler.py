"""Which utterance the worker serves next: pure functions over the worker's utterances.

Utterances that share a sink (one call) play in the order they were opened, so only the oldest
open utterance of each sink is a candidate. A candidate is runnable when it can write audio it
already has, finish, or make synthesis progress, and its sink has room (backpressure).

Among the runnable ones, earliest deadline first: an utterance that is playing and has less than
`STARVING_MS` of audio queued would underrun soon, so it goes first (least queued first); then
utterances still waiting for their first audio (time to first audio is what a listener notices),
oldest first; then the rest take turns, least served first (keeping them in step also lets a backend
batch their chunks).
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


STARVING_MS = 300.0


def pick_next(runnable: list[Utterance]) -> Utterance:
    """The most urgent runnable utterance (see the module docstring)."""

    def key(utt: Utterance) -> tuple[int, float]:
        if utt.first_audio_s is None:
            return (1, utt.opened_s)
        queued_ms = utt.sink.queued_ms
        return (0, queued_ms) if queued_ms < STARVING_MS else (2, float(utt.steps))

    return min(runnable, key=key)
