"""Batches cut to the step budget (`[engine] step_budget_batches`): the learned cost model, pure, with
the costs given, and the scheduler taking its limit."""

from __future__ import annotations

import pytest

from voicertc.engine.step_cost import StepCosts

FLOW = ("flow", 25, False)


def test_no_samples_no_cap():
    assert StepCosts().max_rows(FLOW, budget_ms=200, cap=16) == 16
    assert StepCosts().estimate(FLOW) is None


def test_one_row_count_charges_everything_per_row():
    costs = StepCosts()
    costs.observe(FLOW, 16, 880.0)
    assert costs.estimate(FLOW) == (0.0, 55.0)
    assert costs.max_rows(FLOW, budget_ms=200, cap=16) == 3


def test_a_cpu_like_cost_is_cut_and_a_gpu_like_cost_is_not():
    cpu, gpu = StepCosts(), StepCosts()
    for rows in (16, 3, 3, 1):
        cpu.observe(FLOW, rows, 5.0 + 55.0 * rows)  # all per row
        gpu.observe(FLOW, rows, 400.0 + 6.0 * rows)  # all fixed (launch-bound)
    fixed, per_row = cpu.estimate(FLOW)  # type: ignore[misc]
    assert fixed == pytest.approx(5.0) and per_row == pytest.approx(55.0)
    assert cpu.max_rows(FLOW, budget_ms=200, cap=16) == 3
    fixed, per_row = gpu.estimate(FLOW)  # type: ignore[misc]
    assert fixed == pytest.approx(400.0) and per_row == pytest.approx(6.0)
    assert gpu.max_rows(FLOW, budget_ms=200, cap=16) == 16


def test_at_least_one_row_and_never_more_than_the_cap():
    costs = StepCosts()
    costs.observe(FLOW, 1, 900.0)
    assert costs.max_rows(FLOW, budget_ms=200, cap=16) == 1
    costs = StepCosts()
    costs.observe(FLOW, 2, 1.0)
    assert costs.max_rows(FLOW, budget_ms=200, cap=4) == 4
    assert costs.max_rows(FLOW, budget_ms=200, cap=0) == 1


def test_keys_are_learned_apart_and_old_samples_age_out():
    costs = StepCosts(window=4)
    costs.observe(("decode",), 8, 40.0)
    costs.observe(FLOW, 4, 800.0)
    assert costs.max_rows(("decode",), 200, 16) == 16  # 5 ms per row
    assert costs.max_rows(FLOW, 200, 16) == 1
    for _ in range(4):  # the flow got cheaper (a warm cache, another chunk size): the old sample leaves
        costs.observe(FLOW, 4, 40.0)
    assert costs.max_rows(FLOW, 200, 16) == 16


def test_a_falling_cost_with_more_rows_is_not_a_negative_price():
    costs = StepCosts()
    costs.observe(FLOW, 1, 100.0)
    costs.observe(FLOW, 8, 90.0)  # noise: bigger batch measured faster
    fixed, per_row = costs.estimate(FLOW)  # type: ignore[misc]
    assert per_row == 0.0 and fixed > 0
    assert costs.max_rows(FLOW, 200, 16) == 16


@pytest.mark.parametrize(("rows", "ms"), [(0, 10.0), (1, -1.0)])
def test_bad_samples_are_refused(rows, ms):
    with pytest.raises(ValueError):
        StepCosts().observe(FLOW, rows, ms)
