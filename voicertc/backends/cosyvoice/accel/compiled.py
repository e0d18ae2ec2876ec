"""`[engine] compile` with `cuda_graphs`: a captured step compiled by inductor first, and never again
while calls speak.

Engine thread. `compiled_step` turns a static step into one inductor program with every input dimension
symbolic (one compile serves every bucket of a stage). Compiling costs seconds on a CPU and about a
minute per graph on a GPU host, so it belongs to warm-up: once the engine is warm its users are
*sealed*, and a bucket met later whose shapes or tensors would make dynamo compile again runs the
uncompiled step instead (captured all the same, counted) — `call_sealed` — rather than holding the
engine thread for a minute while every call underruns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.fx.experimental._config as fx_config

logger = logging.getLogger(__name__)

R = TypeVar("R")

COMPILES_MAX = 64  # compiled graphs one function may hold (instances x pool generations x row cases)


def compiled_step(fn: Callable[..., R], dynamic: bool | None = True) -> Callable[..., R]:
    """`fn` through inductor, whole (`fullgraph`: a graph break is an error at warm-up, not a slow
    path). `dynamic=True`: every input dimension symbolic; sizes that happen to be equal at the first
    call (2 rows and the K/V pair, 8 rows and 8 heads) are not merged into one symbol (duck sizing would
    specialise both, and compile again per row bucket). `None`: dynamo's default (static first, then
    the dimensions that changed; the caller may mark dimensions with `maybe_mark_dynamic`)."""
    fx_config.use_duck_shape = False
    # dynamo keys its compiles on the code object: every instance (and pool generation) of a step in
    # the process adds guards; past the recompile limit it would run the step eagerly without a word
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILES_MAX)
    return torch.compile(fn, fullgraph=True, dynamic=dynamic)


def call_sealed(compiled: Callable[..., R], raw: Callable[..., R], *args: Any) -> tuple[R, bool]:
    """`compiled(*args)` if that needs no compile, else `raw(*args)`; and whether it was the compiled
    one. For a bucket met after warm-up: its step is then captured from whichever ran."""
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            return compiled(*args), True
    except RuntimeError as exc:
        if "recompile" not in str(exc):
            raise
        logger.warning("a step would compile again after warm-up; it runs uncompiled (%s)", _first(exc))
        return raw(*args), False


def _first(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip().startswith("-")]
    return lines[0] if lines else str(exc).splitlines()[0]
