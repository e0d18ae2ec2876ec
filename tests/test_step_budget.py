"""How many repeated steps one engine unit makes under `[engine] max_step_ms` (pure, injected clock)."""

from __future__ import annotations

from voicertc.backends.cosyvoice.serve.step_budget import StepBudget


def steps_in_one_unit(costs: list[float], budget_s: float, limit: int = 100) -> int:
    """Run steps of the given costs (one per element, the last repeated) until the unit says stop."""
    now = [0.0]
    unit = StepBudget(budget_s, clock=lambda: now[0]).start()
    for n in range(1, limit + 1):
        now[0] += costs[min(n - 1, len(costs) - 1)]
        if not unit.another():
            return n
    return limit


def test_a_unit_stops_before_a_step_that_would_pass_the_budget():
    # costs in 64ths of a second (exact in binary): budget 16/64
    assert steps_in_one_unit([4 / 64], budget_s=16 / 64) == 4  # 16/64 exactly fits
    assert steps_in_one_unit([5 / 64], budget_s=16 / 64) == 3  # 15/64; a fourth would make 20/64
    assert steps_in_one_unit([0.3], budget_s=0.2) == 1  # one step always runs, however long


def test_the_next_step_is_predicted_from_the_last_one():
    # a costly first step (the encoder with the first Euler step) exactly at half the budget, then cheap
    # ones: 8, 10, 12, 14, 16 / 64
    assert steps_in_one_unit([8 / 64, 2 / 64], budget_s=16 / 64) == 5
    assert steps_in_one_unit([9 / 64, 2 / 64], budget_s=16 / 64) == 1  # predicted 18/64: stop
    # cheap, then one step turns costly: the unit stops after it (14/64 + 10/64 would pass)
    assert steps_in_one_unit([2 / 64, 2 / 64, 10 / 64], budget_s=16 / 64) == 3


def test_no_budget_means_no_bound():
    assert steps_in_one_unit([5.0], budget_s=0.0, limit=12) == 12
