"""Engine-thread commands (`submit_command`), the open count that drops at cancel() time, and the
worker never stepping an utterance a cancel released in the same loop iteration."""

from __future__ import annotations

import threading

import pytest
from engine_helpers import EventLog, RecordingSink

from voicertc.config import FakeConfig
from voicertc.engine import Cancelled, Done
from voicertc.engine.fake import FakeBackend, FakeEngine
from voicertc.engine.pool import EnginePool
from voicertc.engine.worker import EngineWorker
from voicertc.errors import EngineStoppedError, InputError


def test_a_command_runs_on_the_engine_thread_and_its_result_or_error_comes_back():
    engine = FakeEngine(FakeConfig(ttfa_ms=0, rtf=0.0))
    engine.start()
    try:
        seen = engine.submit_command(lambda b: (threading.current_thread().name, b.name)).result(10)
        assert seen == (f"voicertc-{engine.name}", "fake")

        def boom(backend):
            raise ValueError("bad command")

        with pytest.raises(ValueError, match="bad command"):
            engine.submit_command(boom).result(10)
        log = EventLog()  # the engine keeps serving after a failed command
        uid = engine.say(None, RecordingSink(), log, "Still speaking.")
        log.wait_terminal([uid])
        assert isinstance(log.of(uid)[-1], Done)
    finally:
        engine.stop()


def test_a_command_on_a_stopped_engine_fails_with_engine_stopped():
    engine = FakeEngine(FakeConfig(ttfa_ms=0))
    with pytest.raises(EngineStoppedError):
        engine.submit_command(lambda b: 1).result(1)
    engine.start()
    engine.stop()
    with pytest.raises(EngineStoppedError):
        engine.submit_command(lambda b: 1).result(1)


def test_the_pool_runs_a_command_on_the_first_worker_or_broadcasts_it():
    workers = [EngineWorker(FakeBackend(FakeConfig(ttfa_ms=0)), name=f"w{i}") for i in range(2)]
    pool = EnginePool(workers)
    pool.start()
    try:
        assert pool.submit_command(lambda b: threading.current_thread().name).result(10) == "voicertc-w0"
        names = [f.result(10) for f in pool.broadcast_command(lambda b: threading.current_thread().name)]
        assert names == ["voicertc-w0", "voicertc-w1"]
    finally:
        pool.stop()


def _held_engine(**kwargs):
    """An engine whose utterances stay open (backpressure: the sinks never drain)."""
    engine = FakeEngine(FakeConfig(ttfa_ms=0, rtf=0.0, chunk_ms=100), **kwargs)
    engine.start()
    return engine


@pytest.mark.parametrize("pooled", [False, True])
def test_the_open_count_drops_when_cancel_is_called_not_when_the_worker_applies_it(pooled):
    worker = EngineWorker(FakeBackend(FakeConfig(ttfa_ms=0, rtf=0.0)), max_utterances=2)
    engine = EnginePool([worker], max_utterances=2) if pooled else worker
    gate, entered = threading.Event(), threading.Event()
    engine.start()
    try:
        log = EventLog()
        a = engine.say(None, RecordingSink(room_samples=1), log, "Held. " * 20)
        b = engine.say(None, RecordingSink(room_samples=1), log, "Held too. " * 20)
        assert engine.open_count == 2
        with pytest.raises(InputError, match="too many open utterances"):
            engine.say(None, RecordingSink(), log, "refused")

        def block(backend):  # hold the engine thread so the cancel below cannot be applied yet
            entered.set()
            gate.wait(10)

        blocked = worker.submit_command(block)
        assert entered.wait(10)
        engine.cancel(a)
        assert engine.open_count == 1  # before the worker has seen the Cancel
        c = engine.open_utterance(None, RecordingSink(room_samples=1), log)  # fits under the limit again
        gate.set()
        blocked.result(10)
        log.wait_terminal([a])
        assert isinstance(log.of(a)[-1], Cancelled) and engine.open_count == 2
        engine.cancel(b)
        engine.cancel(c)
        log.wait_terminal([b, c])
        assert engine.open_count == 0
    finally:
        gate.set()
        engine.stop()


class CancelsDuringSelection(FakeBackend):
    """While the worker picks runnable heads, a caller cancels the one it will pick; records steps."""

    def __init__(self) -> None:
        super().__init__(FakeConfig(ttfa_ms=0, rtf=0.0))
        self.engine: EngineWorker | None = None
        self.target: str | None = None
        self.stepped_released: list[str] = []
        self.fired = False

    def has_work(self, utt, now_s):
        work = super().has_work(utt, now_s)
        if work and utt.utterance_id == self.target and not self.fired:
            self.fired = True
            assert self.engine is not None
            self.engine.cancel(utt.utterance_id)  # queued now, drained before the step
        return work

    def step(self, utt, now_s):
        if utt.backend_state is None:
            self.stepped_released.append(utt.utterance_id)
        return super().step(utt, now_s)


def test_a_cancel_drained_between_selection_and_step_is_never_stepped():
    backend = CancelsDuringSelection()
    engine = EngineWorker(backend)
    backend.engine = engine
    engine.start()
    try:
        log = EventLog()
        backend.target = "victim"
        engine.open_utterance(None, RecordingSink(), log, utterance_id="victim")
        engine.push_text("victim", "This utterance is cancelled while it is being picked.")
        engine.end_input("victim")
        log.wait_terminal(["victim"])
        assert backend.fired and [type(e) for e in log.of("victim")] == [Cancelled]
        assert backend.stepped_released == []
        other = engine.say(None, RecordingSink(), log, "The next one is fine.")
        log.wait_terminal([other])
        assert isinstance(log.of(other)[-1], Done)
    finally:
        engine.stop()
