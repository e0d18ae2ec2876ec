"""/metrics exports the engine's step times (histogram, longest step, steps over engine.max_step_ms)."""

from __future__ import annotations

from signaling.metrics import Metrics
from voicertc.engine.step_stats import StepStats


def test_step_times_are_rendered_when_the_engine_keeps_them():
    stats = StepStats(max_step_ms=200.0)
    for ms in (40.0, 180.0, 450.0):
        stats.observe(ms, cpu_ms=ms / 1.5)
    metrics = Metrics()
    assert "voicertc_engine_step" not in metrics.render()  # an engine without step stats
    metrics.engine_steps = lambda: stats
    text = metrics.render()
    assert 'voicertc_engine_step_seconds_bucket{le="0.05"} 1' in text
    assert 'voicertc_engine_step_seconds_bucket{le="+Inf"} 3' in text
    assert "voicertc_engine_step_seconds_sum 0.67" in text
    assert "voicertc_engine_step_max_seconds 0.45" in text
    assert "voicertc_engine_steps_over_budget_total 1" in text
    assert "voicertc_engine_step_max_cpu_seconds 0.3" in text
