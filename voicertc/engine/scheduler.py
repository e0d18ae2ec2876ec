"""Which work the worker runs next, as one batch: pure functions over planned units (no clock, no I/O).

Utterances that share a sink (one call) play in the order they were opened, so only the oldest
open utterance of each sink is a candidate. A candidate is runnable when it can write audio it
already has, finish, or make synthesis progress, and its sink has room (backpressure).

Priorities, earliest deadline first: an utterance that is playing and has less than `STARVING_MS` of
audio queued would underrun soon, so it goes first (least queued first); then utterances still waiting
for their first audio (time to first audio is what a listener notices), oldest first; then the rest take
turns, least served first. An utterance that goes (or once went) `AUDIO_STEPS` units without making
audio is not streaming (far more than any streaming chunk needs: a speed-changed CosyVoice2 segment is
synthesised whole, in windows of up to 500 tokens): it takes turns with the rest whatever its
deadline, since serving it first cannot keep it fed and would starve the calls that can be.

Batches: the most urgent unit leads; every other unit with the same `batch_key` joins it, most urgent
first, up to `max_batch` (all runnable LLM decodes in one forward; flow chunks that advance by the same
number of tokens, or the rest of one started chunk; vocoder runs across utterances). Pull-forward: when the
leader is a flow chunk to start and some decoding utterance is at most `pull_tokens` tokens short of a
chunk with the same advance, the decodes run first (the leader is not starving), so the chunks then run
as one batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from voicertc.engine.backend import Backend
from voicertc.engine.utterance import Utterance
from voicertc.engine.work import Decode, FlowChunk, Job, batch_key

J = TypeVar("J", bound=Job[Any])


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
    if utt.held:
        return utt.sink.has_room()
    if utt.synthesis_done:
        return True
    return utt.sink.has_room() and backend.has_work(utt, now_s)


STARVING_MS = 300.0
# A streaming CosyVoice2 chunk: <= 103 decodes (a 100-token hop + lookahead), its flow and vocoder units.
AUDIO_STEPS = 160


def urgency(utt: Utterance) -> tuple[int, float]:
    """Sort key, most urgent first (see the module docstring)."""
    if max(utt.steps - utt.steps_at_audio, utt.longest_audio_gap_steps) >= AUDIO_STEPS:
        return (2, float(utt.steps))
    if utt.first_audio_s is None:
        return (1, utt.opened_s)
    queued_ms = utt.sink.queued_ms
    return (0, queued_ms) if queued_ms < STARVING_MS else (2, float(utt.steps))


def pick_next(runnable: list[Utterance]) -> Utterance:
    """The most urgent runnable utterance (see the module docstring)."""
    return min(runnable, key=urgency)


def form_batch(candidates: Sequence[J], max_batch: int, pull_tokens: int = 0) -> list[J]:
    """The batch to run now: the most urgent unit and its compatible partners (module docstring)."""
    if not candidates:
        return []
    ranked = sorted(candidates, key=lambda job: urgency(job.utt))
    leader = ranked[0]
    work = leader.work
    if isinstance(work, FlowChunk) and _may_pull(work, pull_tokens) and urgency(leader.utt)[0] != 0:
        if any(_pullable(job, work.advance_tokens, pull_tokens) for job in ranked):
            decodes = [job for job in ranked if isinstance(job.work, Decode)]
            decodes.sort(key=lambda job: not _pullable(job, work.advance_tokens, pull_tokens))  # stable
            return decodes[: max(1, max_batch)]
    key = batch_key(work)
    if key is None:
        return [leader]
    return [job for job in ranked if batch_key(job.work) == key][: max(1, max_batch)]


def _may_pull(work: FlowChunk, pull_tokens: int) -> bool:
    return pull_tokens > 0 and not work.final and not work.solve  # a started chunk takes no partners


def _pullable(job: Job[Any], advance: int, pull_tokens: int) -> bool:
    work = job.work
    return isinstance(work, Decode) and 0 < work.until_chunk <= pull_tokens and work.chunk_advance == advance
