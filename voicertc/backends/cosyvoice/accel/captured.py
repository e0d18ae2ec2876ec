"""Captured static-shape steps: one mechanism for every stage that `[engine] cuda_graphs` captures.

Runs on the engine thread. On a GPU the flow estimator and HiFT are launch-bound (thousands of small
kernels a step, each microseconds of work), so each is captured once per padded shape as a CUDA graph
and replayed. `StaticSteps` wraps a step `fn(*tensors) -> tuple[Tensor, ...]` whose rows are
independent: a call's inputs are copied into the static buffers of its bucket (rows padded with zeros
up to the bucket's row count; every other dimension exact), the bucket's replay runs, and each output is
cut back to the call's rows. A bucket is made on first use (`capture`), within a memory budget shared
by every captured stage (`GraphBudget`, `[engine] graph_memory_mb`); a call that fits no bucket, or whose
bucket would pass the budget, is refused (`run` returns None) and the caller runs it eagerly, counted.

`capture` turns a step on static buffers into its replay: a `CudaCapture` on CUDA (every bucket's graph
in one private memory pool: replays are sequential on the engine thread, a step writes its results into
static output buffers and each call's outputs are cloned before the next replay, so what a graph
allocates is an intermediate that the other graphs' replays may reuse, and the pool costs about the
largest bucket's working set rather than every bucket's outputs); `run_eagerly` (the same
static step, not captured) on CPU, where the tests prove static == eager. A step that fails to capture
(an op that syncs with the host, say) turns its stage eager for good, logged once and counted: the
engine keeps speaking.

`compile=True` (`[engine] compile` with `cuda_graphs`) runs the step through `torch.compile` (inductor,
every input dimension symbolic: one compile serves every bucket) before it is captured, so a replay
launches a few fused kernels where the eager step launched thousands of small ones; the compile
happens in the first bucket's capture, at warm-up. After warm-up (`seal`) a bucket that would compile
again is captured from the uncompiled step, counted (`accel.compiled`).

An input may also be a `FillsBuffer` instead of a tensor: something gathered from several places (the
flow's cached keys and values of every utterance in the batch) that writes itself straight into the
bucket's static buffer, so it is copied once instead of being made whole and then copied in.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.accel.compiled import call_sealed, compiled_step
from voicertc.backends.cosyvoice.llm.graphs import capture_stream, capturing

logger = logging.getLogger(__name__)

Outputs = tuple[Tensor, ...]
Step = Callable[[], Outputs]
Capture = Callable[[Step], Step]


class FillsBuffer(Protocol):
    """A step input not yet made: its shape, dtype and device, and how to write it into a buffer of
    that shape (`fill`) or make it (`tensor`, for a step run eagerly)."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def element_size(self) -> int: ...

    def fill(self, out: Tensor) -> None: ...

    def tensor(self) -> Tensor: ...


StepInput = Tensor | FillsBuffer


def as_tensors(inputs: Sequence[StepInput]) -> list[Tensor]:
    """The inputs made whole (a step run eagerly, outside every bucket)."""
    return [x if isinstance(x, Tensor) else x.tensor() for x in inputs]


def run_eagerly(step: Step) -> Step:
    """The "capture" of a device without graphs: the static step itself, run each time."""
    return step


class CudaCapture:
    """Captures steps (which read and write only static buffers) as CUDA graphs sharing one memory pool;
    a replay returns the captured outputs (static tensors, overwritten by the next replay)."""

    def __init__(self) -> None:
        self.pool: Any = None  # torch's graph pool handle (made on the first capture)

    def __call__(self, step: Step) -> Step:
        try:
            return self._capture(step)
        except RuntimeError as exc:  # cuDNN may find no engine under capture (seen in float32): without
            if not torch.backends.cudnn.enabled:  # it, the convolutions are ATen's own kernels
                raise
            logger.warning(
                "capture with cuDNN failed (%s); capturing without cuDNN", str(exc).splitlines()[0]
            )
            with torch.backends.cudnn.flags(enabled=False):
                return self._capture(step)

    def _capture(self, step: Step) -> Step:
        side = capture_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy inits and allocator growth happen outside the capture
                step()
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with capturing(graph, self.pool):
                outputs = step()
        except Exception:
            self.pool = None  # the failed capture's pool is not reused (the next capture takes a new one)
            raise

        def replay() -> Outputs:
            graph.replay()
            return outputs

        return replay


def row_bucket(rows: int, max_rows: int, smallest: int = 1) -> int | None:
    """The padded row count of a call: the next power of two >= rows (from `smallest`), capped at
    `max_rows`; None past it."""
    if rows > max_rows:
        return None
    padded = smallest
    while padded < rows:
        padded *= 2
    return min(padded, max_rows)


@dataclass
class GraphBudget:
    """Bytes the captured buckets of every stage may hold together (static buffers + graph pools)."""

    limit_bytes: int
    used_bytes: int = 0

    def take(self, size: int) -> bool:
        if self.used_bytes + size > self.limit_bytes:
            return False
        self.used_bytes += size
        return True


@dataclass
class StageStats:
    """What one captured stage did (for /metrics and the start-up log)."""

    replays: int = 0
    eager: int = 0  # calls outside every bucket (or past the budget): run with their exact shapes
    captures: int = 0
    uncompiled: int = 0  # buckets captured from the uncompiled step (compiling again refused when sealed)
    capture_s: float = 0.0
    failed: str | None = None  # why a capture failed (the stage runs eagerly since)
    bytes: int = 0
    by_shape: dict[Hashable, int] = field(default_factory=dict)


@dataclass
class _Bucket:
    inputs: list[Tensor]
    replay: Step


class StaticSteps:
    """Static-shape replays of one stage's step, one bucket per padded shape (engine thread)."""

    def __init__(
        self,
        name: str,
        fn: Callable[..., Outputs],
        in_row_dims: Sequence[int] | int,
        out_row_dims: Sequence[int] | int,
        *,
        capture: Capture = run_eagerly,
        budget: GraphBudget | None = None,
        pool_factor: float = 1.25,
        compile: bool = False,
    ) -> None:
        self.name = name
        self.raw_fn = fn
        self.fn = compiled_step(fn) if compile else fn
        self.compiled = compile
        self.sealed = False  # warm-up is over: no bucket may compile again (`seal`)
        # each input's / output's row dimension (one int: the same for all, however many there are)
        self.in_row_dims = in_row_dims if isinstance(in_row_dims, int) else tuple(in_row_dims)
        self.out_row_dims = out_row_dims if isinstance(out_row_dims, int) else tuple(out_row_dims)
        self.capture = capture
        self.budget = budget or GraphBudget(limit_bytes=2**31)
        self.pool_factor = pool_factor  # static inputs + a share of the stage's one graph pool
        self.stats = StageStats()
        self._buckets: dict[Hashable, _Bucket] = {}
        # static inputs by (position, shape, dtype): a bucket's input is a contiguous view of the first
        # elements of a buffer made for a bucket at least as large (inputs are copied in right before
        # each replay, and replays are sequential), so the buffers cost the largest bucket's inputs,
        # not their sum; contiguous, every bucket's inputs have the strides a compiled step assumed
        self._buffers: dict[tuple[int, tuple[int, ...], torch.dtype], Tensor] = {}
        # static outputs likewise (outputs are cloned right after each replay): the step writes its
        # results into them, so what it allocates is an intermediate the graphs' shared pool reuses,
        # instead of every bucket's outputs held in the pool for the life of its graph
        self._out_buffers: dict[tuple[int, tuple[int, ...], torch.dtype], Tensor] = {}

    def seal(self) -> None:
        """Warm-up is over: a bucket made from now on whose compiled step would compile again is
        captured from the uncompiled step instead (a compile holds the engine thread for a minute)."""
        self.sealed = True

    def run(
        self,
        padded_rows: int,
        inputs: Sequence[StepInput],
        branch: Hashable = None,
        borrowed: frozenset[int] = frozenset(),
    ) -> Outputs | None:
        """The step's outputs for `inputs` (their real rows), or None: not captured (run it eagerly).
        `branch`: what else picks the step's kernels besides the input shapes (a bucket per value).
        `borrowed`: outputs returned as views of static storage instead of copies, valid until the
        next `run` (for a caller that copies them on at once)."""
        if self.stats.failed is not None:
            self.stats.eager += 1
            return None
        in_dims = _dims(self.in_row_dims, len(inputs))
        rows = inputs[0].shape[in_dims[0]]
        shapes = (_shape_without(x, d) for x, d in zip(inputs, in_dims, strict=True))
        key = (padded_rows, *shapes) if branch is None else (padded_rows, branch, *shapes)
        bucket = self._buckets.get(key) or self._make(key, padded_rows, inputs)
        if bucket is None:
            self.stats.eager += 1
            return None
        self._load(bucket.inputs, inputs, rows, padded_rows)
        outputs = bucket.replay()
        self.stats.replays += 1
        self.stats.by_shape[key] = self.stats.by_shape.get(key, 0) + 1
        out_dims = _dims(self.out_row_dims, len(outputs))
        views = [out.narrow(dim, 0, rows) for out, dim in zip(outputs, out_dims, strict=True)]
        return tuple(view if i in borrowed else view.clone() for i, view in enumerate(views))

    def _view(
        self, position: int, shape: list[int], like: StepInput, buffers: dict | None = None
    ) -> Tensor | None:
        """A contiguous view of shape `shape` on the first elements of a static buffer of this position
        (of `buffers`: the inputs' by default) that is large enough."""
        size = math.prod(shape)
        for (i, _, dtype), buffer in (self._buffers if buffers is None else buffers).items():
            if i == position and dtype == like.dtype and buffer.device == like.device:
                if buffer.numel() >= size:
                    return buffer.view(-1)[:size].view(shape)
        return None

    def _load(
        self, static: Sequence[Tensor], inputs: Sequence[StepInput], rows: int, padded_rows: int
    ) -> None:
        """The call's inputs into a bucket's static buffers, pad rows zeroed."""
        for buffer, value, dim in zip(static, inputs, _dims(self.in_row_dims, len(inputs)), strict=True):
            if isinstance(value, Tensor):
                buffer.narrow(dim, 0, rows).copy_(value)
            else:
                value.fill(buffer.narrow(dim, 0, rows))
            if rows < padded_rows:
                buffer.narrow(dim, rows, padded_rows - rows).zero_()

    def _make(self, key: Hashable, padded_rows: int, like: Sequence[StepInput]) -> _Bucket | None:
        held: list[Tensor | None] = []
        missing: list[tuple[int, list[int], StepInput]] = []  # (position, shape, like): buffers to make
        in_dims = _dims(self.in_row_dims, len(like))
        for i, (value, dim) in enumerate(zip(like, in_dims, strict=True)):
            shape = list(value.shape)
            shape[dim] = padded_rows
            buffer = self._view(i, shape, value)
            if buffer is None:
                missing.append((i, shape, value))
            held.append(buffer)
        new_bytes = sum(math.prod(shape) * value.element_size() for _, shape, value in missing)
        size = int(self.pool_factor * new_bytes)
        if not self.budget.take(size):  # before anything is allocated: past the budget is eager, not OOM
            return None
        for i, shape, value in missing:
            held[i] = self._buffers[(i, tuple(shape), value.dtype)] = _static_zeros(shape, value)
        static = [buffer for buffer in held if buffer is not None]
        # capture on this call's inputs: a shared buffer may hold another bucket's (e.g. indices past
        # this bucket's frames), and the warm-up runs of a capture compute on them
        self._load(static, like, like[0].shape[in_dims[0]], padded_rows)
        started = time.perf_counter()
        try:
            fn, first = self._first_run(static)
            outputs, out_bytes = self._static_outputs(first, static)  # one eager run: their shapes
            size += out_bytes
            self.budget.used_bytes += out_bytes

            def step() -> Outputs:
                results = fn(*static)
                for out, result in zip(outputs, results, strict=True):
                    if out is not None:
                        out.copy_(result)
                return tuple(r if o is None else o for o, r in zip(outputs, results, strict=True))

            replay = self.capture(step)
        except Exception as exc:  # noqa: BLE001 - an uncapturable step: eager from now on, said once
            self.budget.used_bytes -= size
            self.stats.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            logger.warning(
                "%s: capture failed for %s (%s); this stage runs eagerly", self.name, key, self.stats.failed
            )
            return None
        seconds = time.perf_counter() - started
        self.stats.captures += 1
        self.stats.capture_s += seconds
        self.stats.bytes += size
        self._buckets[key] = bucket = _Bucket(static, replay)
        logger.info("%s captured for %s (%.1f MB, %.0f ms)", self.name, key, size / 2**20, 1000 * seconds)
        return bucket

    def _first_run(self, static: list[Tensor]) -> tuple[Callable[..., Outputs], Outputs]:
        """The step this bucket captures (compiled, or uncompiled where sealed and compiling again)
        and its first results."""
        if not (self.compiled and self.sealed):
            return self.fn, self.fn(*static)
        results, compiled = call_sealed(self.fn, self.raw_fn, *static)
        if compiled:
            return self.fn, results
        self.stats.uncompiled += 1
        return self.raw_fn, results

    def _static_outputs(self, results: Outputs, static: list[Tensor]) -> tuple[list[Tensor | None], int]:
        """Static buffers (views of shared ones, as for inputs) shaped like a step's `results`, and the
        bytes newly allocated for them; None for a result that is a view of a static input (the flow
        step's new keys and values, written into room its input keeps): it is static already."""
        inputs = {buffer.untyped_storage().data_ptr() for buffer in static}
        outputs: list[Tensor | None] = []
        allocated = 0
        for i, result in enumerate(results):
            if result.untyped_storage().data_ptr() in inputs:
                outputs.append(None)
                continue
            buffer = self._view(i, list(result.shape), result, self._out_buffers)
            if buffer is None:
                buffer = _static_zeros(list(result.shape), result)
                self._out_buffers[(i, tuple(result.shape), result.dtype)] = buffer
                allocated += buffer.numel() * buffer.element_size()
            outputs.append(buffer)
        return outputs, allocated


def _static_zeros(shape: list[int], like: StepInput) -> Tensor:
    """A contiguous zero buffer like `like`: an ordinary tensor whether or not a bucket is made under
    inference mode (at warm-up or while calls speak), so a compiled step meets the same kind of input in
    every bucket (it guards on it, and would compile again)."""
    with torch.inference_mode(False):
        return torch.zeros(shape, dtype=like.dtype, device=like.device)


def _dims(dims: tuple[int, ...] | int, count: int) -> tuple[int, ...]:
    return (dims,) * count if isinstance(dims, int) else dims


def _shape_without(x: StepInput, dim: int) -> tuple[int, ...]:
    return tuple(n for i, n in enumerate(x.shape) if i != dim)
