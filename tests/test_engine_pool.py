"""EnginePool: calls are synthesized on several workers at once, a sink's open utterances stay on one
worker, the open-utterance limit is the pool's, and a failed start leaves no worker running."""

from __future__ import annotations

import threading

import pytest
from engine_helpers import EventLog, RecordingSink

from voicertc.assemble import create_engine
from voicertc.config import Config, EngineConfig, FakeConfig
from voicertc.engine import Done
from voicertc.engine.fake import FakeBackend
from voicertc.engine.pool import EnginePool
from voicertc.engine.worker import EngineWorker
from voicertc.errors import InputError

QUICK = FakeConfig(ttfa_ms=0, rtf=0.0, chunk_ms=100)


class RendezvousBackend(FakeBackend):
    """Every utterance's first step waits until `parties` first steps run at the same moment: with
    fewer workers than parties the barrier times out and the utterance fails."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__(QUICK)
        self.barrier = barrier
        self.met: set[str] = set()

    def step(self, utt, now_s):
        if utt.utterance_id not in self.met:
            self.met.add(utt.utterance_id)
            self.barrier.wait(timeout=10)
        return super().step(utt, now_s)


def _pool(n: int, backend=lambda: FakeBackend(QUICK), max_utterances: int = 64) -> EnginePool:
    workers = [EngineWorker(backend_factory=backend, name=f"w{i}") for i in range(n)]
    return EnginePool(workers, max_utterances=max_utterances)


def test_two_calls_are_synthesized_at_the_same_time():
    barrier = threading.Barrier(2)
    pool = _pool(2, lambda: RendezvousBackend(barrier))
    pool.start()
    try:
        log, sinks = EventLog(), [RecordingSink(), RecordingSink()]
        uids = [pool.say(None, sink, log, "Two calls speak at once.") for sink in sinks]
        log.wait_terminal(uids)
    finally:
        pool.stop()
    assert all(isinstance(log.of(uid)[-1], Done) for uid in uids)
    assert [w.stats["utterances"] for w in pool.workers] == [1, 1]
    assert not barrier.broken


def test_a_sinks_open_utterances_stay_on_its_worker():
    pool = _pool(2)
    pool.start()
    try:
        log, sink = EventLog(), RecordingSink()
        first = pool.open_utterance(None, sink, log)  # stays open: no text has ended yet
        second = pool.say(None, sink, log, "After the first.")
        pool.push_text(first, "The first.")
        pool.end_input(first)
        log.wait_terminal([first, second])
        other = pool.say(None, RecordingSink(), log, "Another call.")  # the idle worker takes it
        log.wait_terminal([other])
    finally:
        pool.stop()
    assert sorted(w.stats["utterances"] for w in pool.workers) == [1, 2]
    assert sink.ended == [first, second]  # in order on the sink


def test_the_limit_is_the_pools_and_ended_utterances_ignore_late_commands():
    pool = _pool(2, max_utterances=1)
    pool.start()
    try:
        log = EventLog()
        uid = pool.open_utterance(None, RecordingSink(), log)
        with pytest.raises(InputError, match="limit 1"):
            pool.open_utterance(None, RecordingSink(), log)  # another worker is idle, the pool is full
        pool.push_text(uid, "Now it ends.")
        pool.end_input(uid)
        log.wait_terminal([uid])
        pool.cancel(uid)  # ended: a no-op, not an error
        pool.push_text(uid, "late")
        again = pool.say(None, RecordingSink(), log, "Room again.")
        log.wait_terminal([again])
    finally:
        pool.stop()
    assert isinstance(log.of(again)[-1], Done)


def test_a_failed_start_stops_the_workers_already_started():
    def broken():
        raise RuntimeError("model file missing")

    workers = [EngineWorker(backend_factory=lambda: FakeBackend(QUICK)), EngineWorker(backend_factory=broken)]
    pool = EnginePool(workers)
    with pytest.raises(RuntimeError, match="model file missing"):
        pool.start()
    assert not workers[0].running


def test_factory_builds_a_pool_for_several_workers():
    config = Config(engine=EngineConfig(backend="fake", workers=3), fake=QUICK)
    pool = create_engine(config)
    assert isinstance(pool, EnginePool) and len(pool.workers) == 3
    assert isinstance(create_engine(Config(engine=EngineConfig(backend="fake"))), EngineWorker)
    pool.start()
    try:
        log = EventLog()
        uids = [pool.say(None, RecordingSink(), log, "Hello.") for _ in range(3)]
        log.wait_terminal(uids)
    finally:
        pool.stop()
    assert [w.stats["utterances"] for w in pool.workers] == [1, 1, 1]
