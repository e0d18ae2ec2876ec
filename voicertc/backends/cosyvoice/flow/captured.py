"""The flow estimator as captured static-shape steps: one replay per (rows, frames, cached keys) bucket.

Runs on the engine thread. The explicit-cache form of the estimator (`flow.graph.StreamingEstimator`:
caches in, new caches out) runs on the static buffers of `accel.captured.StaticSteps`, one Euler step
(both CFG rows of every utterance in the batch) per replay. Shapes are made static by padding, exactly:
* rows (2 per utterance) are padded up to a row bucket (2, 4, 8, ... `max_rows`); pad rows are zeros
  with every key visible, so they compute finite values that are dropped;
* cached keys are padded up to a key bucket (multiples of `key_quantum`) and hidden by `attn_bias`, as
  `GraphEstimator` already does for rows of different lengths;
* the chunk's new frames are not padded (a causal conv's tail must come from the real last frames):
  each distinct chunk length is its own bucket (the schedule has few: 2x hop tokens; final chunks vary).
A call outside every bucket (more rows, a longer history) or past the memory budget runs eagerly on the
same module with its exact shapes, counted in `stats.eager`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.accel.captured import (
    Capture,
    GraphBudget,
    StageStats,
    StaticSteps,
    row_bucket,
    run_eagerly,
)
from voicertc.backends.cosyvoice.flow.graph import INPUT_NAMES, GraphEstimator, StreamingEstimator

Outputs = tuple[Tensor, Tensor, Tensor]  # velocity, conv_cache_out, kv_new
IN_ROW_DIMS = {"kv_cache": 2}  # every other input has its rows first
OUT_ROW_DIMS = (0, 0, 2)  # velocity, conv_cache_out, kv_new [A, 2, B, H, T, Dh]


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
        padded_rows = row_bucket(rows, self.max_rows, smallest=2)
        if padded_rows is None or keys > self.max_keys:
            return None
        padded_keys = max(self.key_quantum, -(-keys // self.key_quantum) * self.key_quantum)
        return StepShape(padded_rows, frames, padded_keys)

    def rows_list(self) -> list[int]:
        rows, out = 2, []
        while rows < self.max_rows:
            out.append(rows)
            rows *= 2
        return [*out, self.max_rows]


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
        budget: GraphBudget | None = None,
    ) -> None:
        super().__init__(module.layout)
        self.module = module
        self.buckets = buckets or Buckets()
        self.steps = StaticSteps(
            "flow step",
            module,
            [IN_ROW_DIMS.get(name, 0) for name in INPUT_NAMES],
            OUT_ROW_DIMS,
            capture=capture,
            budget=budget or GraphBudget(limit_bytes=int(memory_mb * 2**20)),
        )

    @property
    def stats(self) -> StageStats:
        return self.steps.stats

    # GraphEstimator: the key capacity packed for a call (the bucket's, so the copy fits its buffer)
    def key_capacity(self, rows: int, frames: int, starts: list[int]) -> int:
        shape = self.buckets.shape(rows, frames, max(starts, default=0))
        return shape.keys if shape is not None else super().key_capacity(rows, frames, starts)

    @torch.inference_mode()
    def run(self, inputs: dict[str, Tensor]) -> Outputs:
        rows, frames = inputs["x"].shape[0], inputs["x"].shape[2]
        keys = inputs["kv_cache"].shape[4]
        shape = self.buckets.shape(rows, frames, keys)
        ordered = [inputs[name] for name in INPUT_NAMES]
        if shape is not None and shape.keys == keys:
            outputs = self.steps.run(shape.rows, ordered)
            if outputs is not None:
                velocity, conv_out, kv_new = outputs
                return velocity, conv_out, kv_new
        else:
            self.steps.stats.eager += 1
        return self.module(*ordered)
