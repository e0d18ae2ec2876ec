"""Helpers for the tests of work done in parts under `[engine] max_step_ms`."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator
from typing import TypeVar

import torch

R = TypeVar("R")


def run_parts(parts: Generator[None, None, R]) -> tuple[R, int]:
    """Exhaust a parts generator under inference mode, as the engine does: (its result, `next()` calls)."""
    calls = 0
    with torch.inference_mode():
        while True:
            calls += 1
            try:
                next(parts)
            except StopIteration as end:
                return end.value, calls


def one_second_clock() -> Callable[[], float]:
    """A step clock that moves one second at every read: a unit predicts its next part at a second, so
    under `max_step_ms=1500` every unit runs exactly one part (or one decode token)."""
    ticks = itertools.count()
    return lambda: float(next(ticks))
