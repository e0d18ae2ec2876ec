"""The flow estimator as captured static-shape steps: one replay per (rows, frames, cached keys) bucket.

Runs on the engine thread. On a GPU the estimator is launch-bound (~2,000 small kernels an Euler step,
each microseconds of work), so the step is captured once per shape as a CUDA graph and replayed: the
explicit-cache form of the estimator (`flow.graph.StreamingEstimator`: caches in, new caches out) is
run on static input buffers, so every replay of a bucket reads and writes the same addresses.

Shapes are made static by padding, exactly:
* rows (2 per utterance: CFG) are padded up to a row bucket (2, 4, 8, ... `max_rows`); pad rows are
  zeros with every key visible, so they compute finite garbage that is dropped;
* cached keys are padded up to a key bucket (multiples of `key_quantum`) and hidden by `attn_bias`,
  as `GraphEstimator` already does for rows of different lengths;
* the chunk's new frames are not padded (a causal conv's tail must come from the real last frames):
  each distinct chunk length is its own bucket (the schedule has few: 2x hop tokens; final chunks vary).

A shape outside every bucket, or one whose capture would pass the memory bound (`memory_mb`), runs
eagerly on the same module with its exact shapes and is counted (`stats.eager`). `capture` turns a
step on static buffers into its replay: `cuda_capture` on CUDA, `run_eagerly` (the same static step,
not captured) on CPU, where the tests prove static == eager.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.flow.graph import (
    INPUT_NAMES,
    GraphEstimator,
    StreamingEstimator,
)

logger = logging.getLogger(__name__)

Outputs = tuple[Tensor, Tensor, Tensor]  # velocity, conv_cache_out, kv_new
Step = Callable[[], Outputs]
Capture = Callable[[Step], Step]


def run_eagerly(step: Step) -> Step:
    """The "capture" of a device without graphs: the static step itself, run each time."""
    return step


def cuda_capture(step: Step) -> Step:
    """Capture `step` (which reads and writes only static buffers) as a CUDA graph; the replay returns
    the captured outputs (static tensors, overwritten by the next replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: lazy inits and allocator growth happen outside the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()

    def replay() -> Outputs:
        graph.replay()
        return outputs

    return replay


@dataclass(frozen=True)
class StepShape:
    rows: int  # padded batch rows
    frames: int  # new mel frames (exact)
    keys: int  # padded cached key frames


@dataclass(frozen=True)
class Buckets:
    """Which padded shapes exist: rows 2, 4, ... `max_rows`; keys multiples of `key_quantum` up to
    `max_keys`. Pure: the choice depends on the request only."""

    max_rows: int = 32
    key_quantum: int = 64
    max_keys: int = 4096

    def shape(self, rows: int, frames: int, keys: int) -> StepShape | None:
        if rows > self.max_rows or keys > self.max_keys:
            return None
        padded_rows = 2
        while padded_rows < rows:
            padded_rows *= 2
        padded_keys = max(self.key_quantum, -(-keys // self.key_quantum) * self.key_quantum)
        return StepShape(min(padded_rows, self.max_rows), frames, padded_keys)

    def rows_list(self) -> list[int]:
        rows, out = 2, []
        while rows < self.max_rows:
            out.append(rows)
            rows *= 2
        return [*out, self.max_rows]


@dataclass
class StepStats:
    replays: int = 0
    eager: int = 0  # steps outside every bucket (or past the memory bound): run with exact shapes
    captures: int = 0
    capture_s: float = 0.0
    bytes: int = 0  # static buffers of every captured bucket
    by_shape: dict[StepShape, int] = field(default_factory=dict)


@dataclass
class _Bucket:
    inputs: dict[str, Tensor]
    replay: Step


class CapturedEstimator(GraphEstimator):
    """Drop-in for the eager estimator in the CFM sampler (`estimator_runner`): each Euler step runs as
    the replay of its bucket, or eagerly with its exact shapes when it fits no bucket."""

    def __init__(
        self,
        module: StreamingEstimator,
        *,
        buckets: Buckets | None = None,
        capture: Capture = run_eagerly,
        memory_mb: float = 2048.0,
    ) -> None:
        super().__init__(module.layout)
        self.module = module
        self.buckets = buckets or Buckets()
        self.capture = capture
        self.memory_bytes = int(memory_mb * 2**20)
        self.stats = StepStats()
        self._graphs: dict[StepShape, _Bucket] = {}

    # GraphEstimator: the key capacity packed for a call (the bucket's, so the copy fits its buffer)
    def key_capacity(self, rows: int, frames: int, starts: list[int]) -> int:
        shape = self.buckets.shape(rows, frames, max(starts, default=0))
        return shape.keys if shape is not None else super().key_capacity(rows, frames, starts)

    @torch.inference_mode()
    def run(self, inputs: dict[str, Tensor]) -> Outputs:
        rows, frames = inputs["x"].shape[0], inputs["x"].shape[2]
        keys = inputs["kv_cache"].shape[4]
        shape = self.buckets.shape(rows, frames, keys)
        bucket = None if shape is None or shape.keys != keys else self._bucket(shape, inputs)
        if bucket is None:
            self.stats.eager += 1
            return self.module(*(inputs[name] for name in INPUT_NAMES))
        for name, value in inputs.items():
            static = bucket.inputs[name]
            row_dim = 2 if name == "kv_cache" else 0
            static.narrow(row_dim, 0, rows).copy_(value)
            if rows < static.shape[row_dim]:
                static.narrow(row_dim, rows, static.shape[row_dim] - rows).zero_()
        velocity, conv_out, kv_new = bucket.replay()
        self.stats.replays += 1
        assert shape is not None  # a bucket exists only for a shape
        self.stats.by_shape[shape] = self.stats.by_shape.get(shape, 0) + 1
        return velocity[:rows].clone(), conv_out[:rows].clone(), kv_new[:, :, :rows].clone()

    def _bucket(self, shape: StepShape, like: dict[str, Tensor]) -> _Bucket | None:
        bucket = self._graphs.get(shape)
        if bucket is not None:
            return bucket
        static = {
            name: value.new_zeros(_padded(name, value.shape, shape.rows)) for name, value in like.items()
        }
        size = sum(t.numel() * t.element_size() for t in static.values())
        if self.stats.bytes + 2 * size > self.memory_bytes:  # inputs + about as much for the graph's pool
            return None
        started = time.perf_counter()

        def step() -> Outputs:
            return self.module(*(static[name] for name in INPUT_NAMES))

        replay = self.capture(step)
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - started
        self.stats.bytes += 2 * size
        self._graphs[shape] = bucket = _Bucket(static, replay)
        logger.info(
            "flow step captured for rows %d x frames %d x keys %d (%.1f MB, %.0f ms)",
            shape.rows,
            shape.frames,
            shape.keys,
            2 * size / 2**20,
            1000 * (time.perf_counter() - started),
        )
        return bucket


def _padded(name: str, shape: torch.Size, rows: int) -> tuple[int, ...]:
    dims = list(shape)
    dims[2 if name == "kv_cache" else 0] = rows
    return tuple(dims)
