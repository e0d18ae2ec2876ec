"""Work in parts: a generator that does one bounded piece per `next()` and returns its result.

A network stage that may take longer than `[engine] max_step_ms` on a slow machine is written once, as
a parts generator (`CausalConditionalDecoder.forward_parts`, `SlotKV.forward_parts`,
`HiFTGenerator.decode_parts`, `CausalHiFTGenerator.step_rows_parts`, ...); the engine calls `next()`
while another part fits in its unit's budget, and the whole call is `run_to_end` of the same generator,
so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Generic, TypeVar

R = TypeVar("R")

Parts = Generator[None, None, R]


def run_to_end(parts: Parts[R]) -> R:
    """Every part of `parts`, in the caller's context; its result."""
    while True:
        try:
            next(parts)
        except StopIteration as end:
            result: R = end.value
            return result


@dataclass(frozen=True)
class InParts(Generic[R]):
    """What an engine command returns when its work is longer than an engine unit may take (a voice's
    prompt caches): the worker runs one part per loop iteration, between the batches of the calls
    speaking meanwhile, and resolves the command's future with the parts' return value (or error)."""

    parts: Parts[R]
