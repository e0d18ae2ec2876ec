"""How the scheduler batches: batch sizes per stage, host time beside model time, runnable queue depth.

Written by one engine worker thread (`observe`), read from any thread for /metrics and benchmarks
(plain ints and floats: a reader may see a batch half-counted, never a broken value).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class StageBatches:
    """Batch sizes of one stage (cumulative bucket counts, Prometheus style)."""

    counts: list[int] = field(default_factory=lambda: [0] * len(BATCH_SIZE_BUCKETS))
    batches: int = 0
    units: int = 0  # sum of the batch sizes
    model_s: float = 0.0  # time inside backend.run for this stage


@dataclass
class BatchStats:
    stages: dict[str, StageBatches] = field(default_factory=dict)
    iterations: int = 0  # loop iterations that ran a batch
    model_s: float = 0.0  # inside backend.run
    host_s: float = 0.0  # the rest of those iterations: planning, scheduling, writing audio, commands
    runnable: int = 0  # units planned in the latest iteration (runnable queue depth)
    runnable_max: int = 0
    # captured static-shape steps per stage: {"flow": {"replays": n, "eager": n, "captures": n}, ...}
    captured: dict[str, dict[str, int]] = field(default_factory=dict)

    def observe(self, stage: str, size: int, model_s: float, step_s: float, runnable: int) -> None:
        batches = self.stages.setdefault(stage, StageBatches())
        for i, bound in enumerate(BATCH_SIZE_BUCKETS):
            if size <= bound:
                batches.counts[i] += 1
        batches.batches += 1
        batches.units += size
        batches.model_s += model_s
        self.iterations += 1
        self.model_s += model_s
        self.host_s += max(0.0, step_s - model_s)
        self.runnable = runnable
        self.runnable_max = max(self.runnable_max, runnable)

    @classmethod
    def merged(cls, parts: Iterable[BatchStats]) -> BatchStats:
        """The sum of several workers' stats (an engine pool); depth = the sum of the latest depths."""
        total = cls()
        for part in parts:
            for stage, b in part.stages.items():
                t = total.stages.setdefault(stage, StageBatches())
                t.counts = [x + y for x, y in zip(t.counts, b.counts, strict=True)]
                t.batches += b.batches
                t.units += b.units
                t.model_s += b.model_s
            total.iterations += part.iterations
            total.model_s += part.model_s
            total.host_s += part.host_s
            total.runnable += part.runnable
            total.runnable_max = max(total.runnable_max, part.runnable_max)
            for stage, counts in part.captured.items():
                into = total.captured.setdefault(stage, {})
                for kind, n in counts.items():
                    into[kind] = into.get(kind, 0) + n
        return total
