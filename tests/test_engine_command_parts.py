"""Engine commands in parts (`InParts`): a command whose work is longer than an engine unit may take (a
voice's prompt caches) goes on a part per loop iteration, between the batches of the calls speaking
meanwhile; its future resolves with the last part's result or any part's error; a stop ends it."""

from __future__ import annotations

import threading
import time

import pytest
from engine_helpers import EventLog, RecordingSink

from voicertc.config import FakeConfig
from voicertc.engine import Cancelled, Done
from voicertc.engine.fake import FakeEngine
from voicertc.engine.parts import InParts
from voicertc.engine.worker import COMMAND_PART_EVERY
from voicertc.errors import EngineStoppedError

LONG_TEXT = " ".join(["A sentence that keeps the fake engine busy for a while."] * 300)  # ~20 min of audio


def _counting(order: list[str], parts: int, fail_at: int | None = None, part_s: float = 0.0):
    def each():
        for i in range(parts):
            order.append("part")
            if i == fail_at:
                raise ValueError(f"part {i} failed")
            time.sleep(part_s)  # the part's work
            yield
        return parts

    return each()


class StarvingSink(RecordingSink):
    """Keeps what it is given but reports nothing queued: its call is always about to underrun."""

    @property
    def queued_ms(self) -> float:
        return 0.0


def _parts_among_batches(sink: RecordingSink, ahead_ms: float, part_s: float) -> list[int]:
    """20 command parts of `part_s` each, submitted once the call on `sink` has `ahead_ms` queued
    (`max_step_ms` 40: a slice of 10 ms): the batches run between each two consecutive parts."""
    order: list[str] = []
    engine = FakeEngine(
        FakeConfig(ttfa_ms=0, rtf=0.0, chunk_ms=10),
        observer=lambda r: order.append("batch"),
        max_step_ms=40,
    )
    engine.start()
    try:
        log = EventLog()
        uid = engine.say(None, sink, log, LONG_TEXT)
        while sink.queued() < ahead_ms * 24:
            time.sleep(0.001)
        assert engine.submit_command(lambda _b: InParts(_counting(order, 20, part_s=part_s))).result(30) == 20
        assert not any(isinstance(e, Done | Cancelled) for e in log.of(uid))  # still speaking throughout
        engine.cancel(uid)
        log.wait_terminal([uid])
    finally:
        engine.stop()
    parts = [i for i, what in enumerate(order) if what == "part"]
    assert len(parts) == 20
    return [order[a:b].count("batch") for a, b in zip(parts, parts[1:], strict=False)]


def test_a_command_in_parts_runs_a_slice_per_batch_while_the_calls_are_ahead():
    # a 10 ms part fills the 10 ms slice: one part per loop iteration, between the call's batches
    assert _parts_among_batches(RecordingSink(), ahead_ms=1000, part_s=0.01) == [1] * 19


def test_quick_parts_share_a_slice():
    gaps = _parts_among_batches(RecordingSink(), ahead_ms=1000, part_s=0.0)
    assert gaps.count(0) >= 10  # many parts in one iteration: a registration of tiny parts is not slowed


def test_while_a_call_is_about_to_underrun_a_command_slice_runs_every_fourth_iteration():
    gaps = _parts_among_batches(StarvingSink(), ahead_ms=0, part_s=0.01)
    assert gaps == [COMMAND_PART_EVERY] * 19


def test_a_failing_part_fails_its_command_only():
    order: list[str] = []
    engine = FakeEngine(FakeConfig(ttfa_ms=0, rtf=0.0))
    engine.start()
    try:
        with pytest.raises(ValueError, match="part 3 failed"):
            engine.submit_command(lambda _b: InParts(_counting(order, 10, fail_at=3))).result(30)
        assert order.count("part") == 4  # no part after the failure
        assert engine.submit_command(lambda _b: InParts(_counting(order, 2))).result(30) == 2
        log = EventLog()
        uid = engine.say(None, RecordingSink(), log, "Still speaking.")
        log.wait_terminal([uid])
        assert isinstance(log.of(uid)[-1], Done)
    finally:
        engine.stop()


def test_a_stop_ends_a_command_in_parts_with_engine_stopped():
    closed: list[bool] = []
    running = threading.Event()

    def endless():
        try:
            while True:
                running.set()
                yield
        finally:
            closed.append(True)

    engine = FakeEngine(FakeConfig(ttfa_ms=0, rtf=0.0))
    engine.start()
    future = engine.submit_command(lambda _b: InParts(endless()))
    assert running.wait(10)
    engine.stop()
    with pytest.raises(EngineStoppedError):
        future.result(10)
    assert closed == [True]
