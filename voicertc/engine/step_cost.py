"""What a batch of each kind costs, learned from the batches the worker ran (pure: no clock, no I/O).

The worker reports every batch it ran as (batch key, rows, model ms). Per key, `StepCosts` fits
ms = fixed + per_row x rows by least squares over the last `window` batches and tells the scheduler how
many rows fit the step budget (`engine.max_step_ms`): budget / per_row, at least one. The fixed part is
left out of the division: whichever batch runs pays it, so only the rows a batch adds can make it
outstay its share. With a single row count seen so far the whole cost is charged per row (the
cautious reading); the smaller batch that follows gives the fit its second point.

On a CPU a flow chunk costs about the same per row however it is batched, so big batches are cut to
what fits; on a GPU, where a chunk's cost is mostly fixed (kernel launches), the fitted per-row cost
is small and batches stay as large as `max_batch`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class StepCosts:
    """Per batch key: the last `window` (rows, ms) samples. Engine thread only."""

    def __init__(self, window: int = 32) -> None:
        if window < 2:
            raise ValueError("window must be at least 2")
        self.window = window
        self._samples: dict[Hashable, deque[tuple[int, float]]] = {}

    def observe(self, key: Hashable, rows: int, ms: float) -> None:
        if rows < 1 or ms < 0:
            raise ValueError(f"a batch has rows >= 1 and ms >= 0, got {rows}, {ms}")
        self._samples.setdefault(key, deque(maxlen=self.window)).append((rows, ms))

    def estimate(self, key: Hashable) -> tuple[float, float] | None:
        """(fixed ms, ms per row) for `key`, or None before its first sample."""
        samples = self._samples.get(key)
        if not samples:
            return None
        n = len(samples)
        mean_rows = sum(r for r, _ in samples) / n
        mean_ms = sum(m for _, m in samples) / n
        var_rows = sum((r - mean_rows) ** 2 for r, _ in samples)
        if var_rows == 0:  # one row count: charge everything per row
            return 0.0, mean_ms / mean_rows
        cov = sum((r - mean_rows) * (m - mean_ms) for r, m in samples)
        per_row = max(0.0, cov / var_rows)
        fixed = max(0.0, mean_ms - per_row * mean_rows)
        return fixed, per_row

    def max_rows(self, key: Hashable, budget_ms: float, cap: int) -> int:
        """How many rows of `key` one batch may take: 1..cap."""
        cap = max(1, cap)
        estimate = self.estimate(key)
        if estimate is None or estimate[1] <= 0.0:
            return cap
        return max(1, min(cap, int(budget_ms // estimate[1])))
