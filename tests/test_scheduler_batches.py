"""The scheduler's batches (pure, hand-built units, no clock): who leads, who joins, pull-forward."""

from __future__ import annotations

from types import SimpleNamespace

from voicertc.engine.scheduler import form_batch
from voicertc.engine.utterance import Utterance
from voicertc.engine.work import Decode, Finish, FlowChunk, Frontend, Job, Prefill, Synth, Vocode


def job(name: str, work, *, opened_s: float = 0.0, queued_ms: float | None = None, steps: int = 0) -> Job:
    """`queued_ms` None = still waiting for its first audio."""
    utt = Utterance(
        utterance_id=name,
        voice="v",
        sink=SimpleNamespace(queued_ms=queued_ms or 0.0),  # type: ignore[arg-type]
        on_event=lambda e: None,
        generation=0,
        opened_s=opened_s,
        first_audio_s=None if queued_ms is None else 1.0,
    )
    utt.steps = steps
    return Job(utt, work)


def names(batch) -> list[str]:
    return [j.utt.utterance_id for j in batch]


def test_every_runnable_decode_joins_one_batch_up_to_max_batch_most_urgent_first():
    jobs = [
        job("fed", Decode(), queued_ms=3000, steps=9),
        job("new", Decode(), opened_s=2.0),
        job("starving", Decode(), queued_ms=100),
        job("flow", FlowChunk(28), queued_ms=2000, steps=1),
        job("older", Decode(), opened_s=1.0),
    ]
    assert names(form_batch(jobs, max_batch=16)) == ["starving", "older", "new", "fed"]
    assert names(form_batch(jobs, max_batch=2)) == ["starving", "older"]


def test_the_most_urgent_unit_leads_and_only_equal_flow_advances_join_it():
    jobs = [
        job("a", FlowChunk(28), queued_ms=50),
        job("b", FlowChunk(28), queued_ms=2000),
        job("c", FlowChunk(50), queued_ms=10),  # more urgent, but another advance
        job("d", FlowChunk(28, final=True), queued_ms=20),
        job("e", Decode(), opened_s=0.0),
    ]
    assert names(form_batch(jobs, max_batch=16)) == ["c"]
    rest = [j for j in jobs if j.utt.utterance_id != "c"]
    assert names(form_batch(rest, max_batch=16)) == ["d"]  # a final chunk only batches with final ones
    rest = [j for j in rest if j.utt.utterance_id != "d"]
    assert names(form_batch(rest, max_batch=16)) == ["a", "b"]


def test_vocoder_runs_of_one_length_batch_across_utterances_and_other_units_run_alone():
    jobs = [
        job("v1", Vocode(frames=58), queued_ms=100),
        job("v2", Vocode(frames=58, final=True), opened_s=1.0),
        job("v3", Vocode(frames=50), opened_s=0.5),  # another vocoder length: not in this batch
    ]
    assert names(form_batch(jobs, max_batch=16)) == ["v1", "v2"]
    jobs = [job("x", Synth(), opened_s=0.0), job("y", Synth(), opened_s=1.0)]
    assert names(form_batch(jobs, max_batch=16)) == ["x"]  # a simple backend's step: one at a time
    for unit in (Frontend(), Prefill(), Finish()):  # cheap transitions share one iteration
        jobs = [job("x", unit, opened_s=0.0), job("y", Decode(), opened_s=0.5), job("z", unit, opened_s=1.0)]
        assert names(form_batch(jobs, max_batch=16)) == ["x", "z"]
    assert form_batch([], max_batch=4) == []


def test_a_partner_a_few_tokens_short_is_decoded_forward_before_the_chunk_runs():
    leader = job("leader", FlowChunk(28), opened_s=0.0)  # waiting for first audio: not starving
    near = job("near", Decode(until_chunk=3, chunk_advance=28), opened_s=1.0)
    other = job("other", Decode(until_chunk=20, chunk_advance=28), opened_s=2.0)
    far = job("far", Decode(until_chunk=2, chunk_advance=50), opened_s=3.0)
    assert names(form_batch([leader, near, other, far], max_batch=16, pull_tokens=8)) == [
        "near", "other", "far",
    ]  # fmt: skip
    assert names(form_batch([leader, near, other, far], max_batch=1, pull_tokens=8)) == ["near"]
    assert names(form_batch([leader, other, far], max_batch=16, pull_tokens=8)) == ["leader"]
    assert names(form_batch([leader, near], max_batch=16, pull_tokens=0)) == ["leader"]  # policy off


def test_a_starving_leader_is_never_held_back_for_a_partner():
    leader = job("leader", FlowChunk(28), queued_ms=120)
    near = job("near", Decode(until_chunk=1, chunk_advance=28), opened_s=1.0)
    assert names(form_batch([leader, near], max_batch=16, pull_tokens=8)) == ["leader"]


def test_the_rest_of_a_started_chunk_batches_with_its_own_members_only_and_pulls_no_partner():
    started = [job(n, FlowChunk(28, solve=7), opened_s=i) for i, n in enumerate(["m1", "m2"])]
    fresh = job("fresh", FlowChunk(28), opened_s=0.5)  # same advance, not part of the started chunk
    other = job("other", FlowChunk(28, solve=8), opened_s=0.7)  # another started chunk
    near = job("near", Decode(until_chunk=1, chunk_advance=28), opened_s=3.0)
    assert names(form_batch([*started, fresh, other, near], max_batch=16, pull_tokens=8)) == ["m1", "m2"]
    assert names(form_batch([fresh, near], max_batch=16, pull_tokens=8)) == ["near"]  # a fresh one does
