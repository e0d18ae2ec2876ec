"""Engine commands in parts (`InParts`): a command whose work is longer than an engine unit may take (a
voice's prompt caches) goes on a part per loop iteration, between the batches of the calls speaking
meanwhile; its future resolves with the last part's result or any part's error; a stop ends it."""

from __future__ import annotations

import threading

import pytest
from engine_helpers import EventLog, RecordingSink

from voicertc.config import FakeConfig
from voicertc.engine import Done
from voicertc.engine.fake import FakeEngine
from voicertc.engine.parts import InParts
from voicertc.errors import EngineStoppedError

LONG_TEXT = " ".join(["A sentence that keeps the fake engine busy for a while."] * 20)


def _counting(order: list[str], parts: int, fail_at: int | None = None):
    def each():
        for i in range(parts):
            order.append("part")
            if i == fail_at:
                raise ValueError(f"part {i} failed")
            yield
        return parts

    return each()


def test_a_command_in_parts_runs_between_a_speaking_calls_batches():
    order: list[str] = []
    engine = FakeEngine(FakeConfig(ttfa_ms=0, rtf=0.0, chunk_ms=10), observer=lambda r: order.append("batch"))
    engine.start()
    try:
        log = EventLog()
        uid = engine.say(None, RecordingSink(), log, LONG_TEXT)
        result = engine.submit_command(lambda _b: InParts(_counting(order, 20))).result(30)
        assert result == 20
        log.wait_terminal([uid])
        assert isinstance(log.of(uid)[-1], Done)
    finally:
        engine.stop()
    parts = [i for i, what in enumerate(order) if what == "part"]
    assert len(parts) == 20
    # one part per loop iteration: while the call had work, a batch ran between every two parts
    assert all(order[a:b].count("batch") == 1 for a, b in zip(parts, parts[1:], strict=False))


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
