"""How long engine steps take: a histogram, the longest one, and how many passed `max_step_ms`.

Written by one engine worker thread (`observe`), read from any thread for /metrics and benchmarks
(plain ints and floats: a reader may see a step half-counted, never a broken value).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

STEP_BUCKETS_MS = (10.0, 25.0, 50.0, 100.0, 150.0, 200.0, 300.0, 500.0, 1000.0, 2000.0, 5000.0)


@dataclass
class StepStats:
    """Wall time of `Backend.step` calls, in ms."""

    max_step_ms: float = 200.0
    buckets_ms: tuple[float, ...] = STEP_BUCKETS_MS
    counts: list[int] = field(default_factory=list)  # cumulative: steps <= each bucket bound
    steps: int = 0
    sum_ms: float = 0.0
    longest_ms: float = 0.0
    over_budget: int = 0  # steps longer than max_step_ms
    longest_cpu_ms: float = 0.0  # the engine thread's own CPU time in its costliest step (no contention)

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets_ms)

    def observe(self, step_ms: float, cpu_ms: float = 0.0) -> bool:
        """Count one step (wall time, and the engine thread's CPU time in it); True when it took
        longer than `max_step_ms`."""
        for i, bound in enumerate(self.buckets_ms):
            if step_ms <= bound:
                self.counts[i] += 1
        self.steps += 1
        self.sum_ms += step_ms
        self.longest_ms = max(self.longest_ms, step_ms)
        self.longest_cpu_ms = max(self.longest_cpu_ms, cpu_ms)
        over = step_ms > self.max_step_ms
        self.over_budget += over
        return over

    @classmethod
    def merged(cls, parts: Iterable[StepStats]) -> StepStats:
        """The sum of several workers' stats (an engine pool)."""
        total = cls()
        for part in parts:
            total.max_step_ms = part.max_step_ms
            total.counts = [a + b for a, b in zip(total.counts, part.counts, strict=True)]
            total.steps += part.steps
            total.sum_ms += part.sum_ms
            total.longest_ms = max(total.longest_ms, part.longest_ms)
            total.longest_cpu_ms = max(total.longest_cpu_ms, part.longest_cpu_ms)
            total.over_budget += part.over_budget
        return total
