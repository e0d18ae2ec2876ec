"""The front-end's replica choice (`voicertc.remote.affinity`, pure, no Ray): per-replica health and
load, pins per call."""

from __future__ import annotations

import pytest

from voicertc.remote import affinity

R1, R2 = "replica-1", "replica-2"


@pytest.fixture(autouse=True)
def fresh():
    affinity.reset()
    yield
    affinity.reset()


def choose(session: str | None, candidates=(R1, R2)) -> str | None:
    return affinity.choose(session, list(candidates), lambda _rid: 0)


def test_a_call_keeps_its_replica():
    first = choose("call-a")
    assert all(choose("call-a") == first for _ in range(5))


def test_new_calls_go_to_the_replica_with_fewer_open_utterances():
    affinity.utterance_opened(R1)
    affinity.utterance_opened(R1)
    affinity.utterance_opened(R2)
    assert choose("new-call") == R2


def test_ended_utterances_stop_counting_at_once():
    for _ in range(3):
        affinity.utterance_opened(R1)
    assert affinity.load(R1) == 3
    for _ in range(3):
        affinity.utterance_closed(R1)
    assert affinity.load(R1) == 0
    affinity.utterance_closed(R1)  # a second close never goes negative
    assert affinity.load(R1) == 0


def test_other_front_ends_load_reported_by_the_replicas_steers_new_calls():
    affinity.report_load(R1, 4)  # four utterances of other front-ends on R1
    affinity.utterance_opened(R2)
    affinity.utterance_opened(R2)
    assert choose("new-call") == R2  # 2 of ours on R2 < 4 of theirs on R1
    affinity.report_load(R1, 0)  # they ended: the next report says so
    assert affinity.load(R1) == 0
    assert choose("another-call") == R1


def test_a_failed_replica_is_avoided_alone_and_taken_back_when_it_recovers():
    pinned = [f"call-{n}" for n in range(4)]
    for session in pinned:
        choose(session)
    affinity.forget_replica(R1)
    assert affinity.avoided(R1) and not affinity.avoided(R2)
    assert all(choose(session) == R2 for session in pinned)  # R1's calls move; R2's stay
    assert choose("new-call") == R2
    assert affinity.recovered(R1) is True
    assert affinity.recovered(R1) is False  # once
    assert choose("after-recovery") == R1  # R1 has no pins now, R2 has five


def test_when_every_replica_failed_the_one_that_failed_longest_ago_is_tried():
    affinity.forget_replica(R2)
    affinity.forget_replica(R1)
    assert choose("call") == R2


def test_first_calls_of_separate_front_ends_do_not_all_pick_one_replica():
    """With nothing open anywhere, the tie is split by the call's key, not by the replica id."""
    firsts = set()
    for n in range(16):
        affinity.reset()  # each a fresh front-end process
        firsts.add(choose(f"front-end-{n}-call-0"))
    assert firsts == {R1, R2}


def test_a_burst_of_calls_spreads_evenly_before_any_utterance_opened():
    chosen = [choose(f"call-{n}") for n in range(8)]
    assert chosen.count(R1) == chosen.count(R2) == 4


def test_a_replica_that_left_the_set_is_forgotten():
    affinity.set_replicas("app", [R1, R2])
    affinity.forget_replica(R1)
    affinity.report_load(R1, 3)
    affinity.set_replicas("app", [R2])
    assert affinity.known_replicas("app") == [R2]
    assert not affinity.avoided(R1) and affinity.load(R1) == 0
