"""How much of one engine unit fits in `[engine] max_step_ms`: a unit made of repeated steps (LLM decode
tokens, Euler steps of a flow chunk) stops before a step that would take it past the budget.

Runs on the engine thread. The budget is the engine thread's CPU time (`time.thread_time`, what the
worker's step statistics call a step's CPU time), so a busy machine does not shrink units for good.
The next step is predicted to cost what the last one did (the steps of one unit have equal shapes); a
unit always makes at least one step, so progress never stops, and the smallest step is the model's
(one decode token, one Euler step of a chunk).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]  # seconds


@dataclass(frozen=True)
class StepBudget:
    """`budget_s` per engine unit (<= 0: unbounded); `clock` is injected by tests."""

    budget_s: float = 0.0
    clock: Clock = time.thread_time

    def start(self) -> UnitClock:
        """A unit starts now."""
        return UnitClock(self.budget_s, self.clock)


@dataclass
class UnitClock:
    """One unit's spending: call `another()` after each step."""

    budget_s: float
    clock: Clock
    started_s: float = field(init=False)
    step_started_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.started_s = self.step_started_s = self.clock()

    def another(self) -> bool:
        """After a step: whether one more step of the same cost still fits in the budget."""
        now = self.clock()
        last_s, self.step_started_s = now - self.step_started_s, now
        return self.budget_s <= 0 or (now - self.started_s) + last_s <= self.budget_s
