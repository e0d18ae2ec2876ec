"""The worker's bounds: an utterance's audio is capped (`utterance_too_long`) and steps are timed.

Finding 2 of issue 11 (one call starves every other): steps are measured against `max_step_ms`
with an injected clock, never the wall clock.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
from engine_helpers import EventLog, RecordingSink

from voicertc.config import FakeConfig
from voicertc.engine import Done, Failed, FirstAudio
from voicertc.engine.fake import SAMPLE_RATE_HZ, FakeEngine
from voicertc.engine.step_stats import StepStats

LONG_TEXT = "This sentence goes on and on, for many seconds of speech. " * 4  # about 15 s of tone


def test_audio_past_max_utterance_s_is_cut_and_the_utterance_fails_with_a_clear_code():
    engine = FakeEngine(FakeConfig(ttfa_ms=0, rtf=0.0, chunk_ms=300), max_utterance_s=1.0)
    engine.start()
    try:
        log, sink = EventLog(), RecordingSink()
        uid = engine.say(None, sink, log, LONG_TEXT)
        log.wait_terminal([uid])
    finally:
        engine.stop()
    events = log.of(uid)
    assert [type(e) for e in events] == [FirstAudio, Failed]
    assert events[-1].code == "utterance_too_long"
    assert "limits.max_utterance_s" in events[-1].message
    assert len(sink.samples(uid)) == SAMPLE_RATE_HZ  # the first second is kept (written), no more
    assert sink.aborted == [uid]
    assert engine._open_count == 0


def test_an_utterance_under_the_cap_is_done():
    engine = FakeEngine(FakeConfig(ttfa_ms=0, rtf=0.0, chunk_ms=300), max_utterance_s=60.0)
    engine.start()
    try:
        log, sink = EventLog(), RecordingSink()
        uid = engine.say(None, sink, log, LONG_TEXT)
        log.wait_terminal([uid])
    finally:
        engine.stop()
    assert isinstance(log.of(uid)[-1], Done)
    assert len(sink.samples(uid)) > 10 * SAMPLE_RATE_HZ


def test_steps_longer_than_max_step_ms_are_counted_and_logged_once_per_utterance(caplog):
    ticks = itertools.count()
    engine = FakeEngine(
        FakeConfig(ttfa_ms=0, rtf=0.0, chunk_ms=200),
        max_step_ms=200.0,
        clock=lambda: 0.25 * next(ticks),  # every clock read is 250 ms later: each step "takes" 250 ms
    )
    engine.start()
    try:
        with caplog.at_level(logging.WARNING, logger="voicertc.engine.worker"):
            log, sink = EventLog(), RecordingSink()
            uid = engine.say(None, sink, log, "A few words, then a few more.")
            log.wait_terminal([uid])
    finally:
        engine.stop()
    stats = engine.step_stats
    assert stats.steps >= 2 and stats.over_budget == stats.steps
    assert stats.longest_ms == pytest.approx(250.0)
    assert log.of(uid)[-1].metrics["max_step_ms"] == pytest.approx(250.0)
    warnings = [r for r in caplog.records if "engine step took" in r.getMessage()]
    assert len(warnings) == 1 and uid in warnings[0].getMessage()


def test_step_stats_histogram_and_merge():
    a, b = StepStats(max_step_ms=100.0), StepStats(max_step_ms=100.0)
    for ms in (5.0, 40.0, 120.0):
        a.observe(ms)
    assert b.observe(3000.0) is True
    merged = StepStats.merged([a, b])
    assert merged.steps == 4 and merged.over_budget == 2 and merged.longest_ms == 3000.0
    assert merged.counts[0] == 1  # <= 10 ms
    assert merged.counts[-1] == 4  # <= 5 s: cumulative
    assert np.isclose(merged.sum_ms, 3165.0)
