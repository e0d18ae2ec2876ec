"""/metrics exports the scheduler's batches: batch size per stage, host vs model time, runnable depth;
the worker keeps them for every batch it runs (a real fake-engine run)."""

from __future__ import annotations

from engine_helpers import EventLog, RecordingSink

from signaling.metrics import Metrics
from voicertc.config import FakeConfig
from voicertc.engine.batch_stats import BatchStats
from voicertc.engine.fake import FakeEngine
from voicertc.engine.pool import EnginePool


def test_batch_stats_are_rendered_per_stage():
    stats = BatchStats()
    stats.observe("decode", 12, model_s=0.030, step_s=0.032, runnable=14)
    stats.observe("decode", 3, model_s=0.010, step_s=0.011, runnable=5)
    stats.observe("flowchunk", 2, model_s=0.100, step_s=0.101, runnable=5)
    metrics = Metrics()
    assert "voicertc_engine_batch_size" not in metrics.render()  # an engine without batch stats
    metrics.engine_batches = lambda: stats
    text = metrics.render()
    assert 'voicertc_engine_batch_size_bucket{stage="decode",le="4"} 1' in text
    assert 'voicertc_engine_batch_size_bucket{stage="decode",le="16"} 2' in text
    assert 'voicertc_engine_batch_size_sum{stage="decode"} 15' in text
    assert 'voicertc_engine_batch_size_count{stage="flowchunk"} 1' in text
    assert "voicertc_engine_model_seconds_total 0.14" in text
    assert "voicertc_engine_host_seconds_total 0.004" in text
    assert "voicertc_engine_runnable_units 5" in text
    assert "voicertc_engine_captured_steps_total" not in text  # nothing captured: no series


def test_captured_steps_are_rendered_per_stage_and_summed_over_workers():
    one = BatchStats(captured={"flow": {"replays": 40, "eager": 2, "captures": 3}})
    two = BatchStats(captured={"flow": {"replays": 10, "eager": 0, "captures": 3}, "vocoder": {"eager": 5}})
    merged = BatchStats.merged([one, two])
    assert merged.captured == {"flow": {"replays": 50, "eager": 2, "captures": 6}, "vocoder": {"eager": 5}}
    metrics = Metrics()
    metrics.engine_batches = lambda: merged
    text = metrics.render()
    assert 'voicertc_engine_captured_steps_total{outcome="eager",stage="flow"} 2' in text
    assert 'voicertc_engine_captured_steps_total{outcome="replays",stage="flow"} 50' in text
    assert 'voicertc_engine_captured_steps_total{outcome="eager",stage="vocoder"} 5' in text


def test_the_worker_and_the_pool_keep_batch_stats():
    engine = FakeEngine(FakeConfig(ttfa_ms=0, rtf=0.0, chunk_ms=200))
    engine.start()
    try:
        log = EventLog()
        uids = [engine.say(None, RecordingSink(), log, f"Utterance {i} is short.") for i in range(3)]
        log.wait_terminal(uids)
    finally:
        engine.stop()
    stats = engine.batch_stats
    assert stats.stages["synth"].batches >= 3 and stats.stages["synth"].units == stats.stages["synth"].batches
    assert stats.iterations == stats.stages["synth"].batches and stats.runnable_max >= 1
    merged = EnginePool([engine, engine]).batch_stats
    assert merged.stages["synth"].units == 2 * stats.stages["synth"].units
