"""The flow estimator as captured static-shape steps: one replay per (rows, frames, cached keys) bucket.

Runs on the engine thread. The explicit-cache form of the estimator (`flow.graph.StreamingEstimator`:
caches in, new caches out) runs on the static buffers of `accel.captured.StaticSteps`, one Euler step
(both CFG rows of every utterance in the batch) per replay. Shapes are made static by padding, exactly:
* rows (2 per utterance) are padded up to a row bucket (2, 4, 8, ... `max_rows`); pad rows are zeros
  with every key visible, so they compute finite values that are dropped;
* cached keys are padded up to a key bucket (`key_quantum` doubling up to `max_keys`) and hidden by
  `attn_bias`, as `GraphEstimator` already does for rows of different lengths;
* the chunk's new frames are padded up to a frame bucket (`frame_buckets`, then multiples of the last):
  the estimator is causal along time (causal convs; the padded keys are hidden by `attn_bias`), so the
  real frames do not see the padding; the conv tails are taken at the real end (`tail_index`) and the
  new keys / values and the velocity are cut back to the real frames.
So a call meets a bounded set of shapes (rows x frames x keys buckets), which `warm` captures before the
engine says ready. A call outside every bucket (more rows, a longer history) or past the memory budget
runs eagerly on the same module with its exact shapes, counted in `stats.eager`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from voicertc.backends.cosyvoice.accel.captured import (
    Capture,
    GraphBudget,
    StageStats,
    StaticSteps,
    StepInput,
    as_tensors,
    row_bucket,
    run_eagerly,
)
from voicertc.backends.cosyvoice.accel.staging import to_device
from voicertc.backends.cosyvoice.flow.graph import (
    INPUT_NAMES,
    MASK_BIAS,
    GraphEstimator,
    StreamingEstimator,
    attention_bias,
    pack_caches,
    pack_for_step,
    unpack_caches,
)
from voicertc.backends.cosyvoice.flow.unet import EstimatorCache

logger = logging.getLogger(__name__)

Outputs = tuple[Tensor, Tensor, Tensor]  # velocity, conv_cache_out, kv_new
STEP_INPUTS = (*INPUT_NAMES, "tail_index")
ROPE_INPUTS = ("rope_cos", "rope_sin")  # the DiT's (CosyVoice3) rotary angles [B, T, Dh]
IN_ROW_DIMS = {"kv_cache": 2}  # every other input has its rows first
OUT_ROW_DIMS = (0, 0, 2)  # velocity, conv_cache_out, kv_new [A, 2, B, H, T, Dh]
KV_NEW = frozenset({2})  # kv_new: a view of the room in the static kv_cache input, copied into each context


@dataclass(frozen=True)
class StepShape:
    rows: int  # padded batch rows
    frames: int  # padded new mel frames
    keys: int  # padded cached key frames


@dataclass(frozen=True)
class Buckets:
    """Which padded shapes exist: rows 2, 4, ... `max_rows`; keys `key_quantum` doubling up to `max_keys`;
    frames the first of `frame_buckets` that holds them, past the last its multiples. Pure."""

    max_rows: int = 32
    key_quantum: int = 64
    max_keys: int = 4096
    frame_buckets: tuple[int, ...] = (64, 128, 256)
    smallest_rows: int = 2  # the estimator's rows come in CFG pairs; the token encoder's one a call

    def shape(self, rows: int, frames: int, keys: int) -> StepShape | None:
        padded_rows = row_bucket(rows, self.max_rows, smallest=self.smallest_rows)
        if padded_rows is None or keys > self.max_keys:
            return None
        return StepShape(padded_rows, self.frames(frames), self.keys(keys))

    def keys(self, keys: int) -> int:
        padded = self.key_quantum
        while padded < keys:
            padded *= 2
        return min(padded, self.max_keys)

    def frames(self, frames: int) -> int:
        for bucket in self.frame_buckets:
            if frames <= bucket:
                return bucket
        last = self.frame_buckets[-1]
        return -(-frames // last) * last

    def rows_list(self) -> list[int]:
        rows, out = self.smallest_rows, []
        while rows < self.max_rows:
            out.append(rows)
            rows *= 2
        return [*out, self.max_rows]

    def keys_list(self, up_to: int) -> list[int]:
        keys, out = self.key_quantum, []
        while keys <= min(up_to, self.max_keys):
            out.append(keys)
            keys *= 2
        return out


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
        compile: bool = False,
    ) -> None:
        super().__init__(module.layout)
        self.module = module = module.with_kv_room()  # new frames written into the step's own buffer
        self.buckets = buckets or Buckets()
        self.input_names = STEP_INPUTS + (ROPE_INPUTS if module.takes_rope else ())
        self.steps = StaticSteps(
            "flow step",
            module,
            [IN_ROW_DIMS.get(name, 0) for name in self.input_names],
            OUT_ROW_DIMS,
            capture=capture,
            budget=budget or GraphBudget(limit_bytes=int(memory_mb * 2**20)),
            compile=compile,
        )
        self._positions_key: tuple[object, ...] | None = None
        self._positions: tuple[Tensor, list[Tensor]] | None = None  # bias, [tail, rope...]

    @property
    def stats(self) -> StageStats:
        return self.steps.stats

    def __call__(
        self,
        x: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        caches: list[EstimatorCache],
        chunk_masks: bool,
    ) -> Tensor:
        # x, mu, cond: [B, 80, T] (B = rows per utterance x utterances); t [B]; spks [B, 80]
        batch, _, frames = x.shape
        rows = batch // len(caches)
        starts = [cache.frames for cache in caches]
        shape = self.buckets.shape(batch, frames, max(starts, default=0))
        if shape is None:
            self.steps.stats.eager += 1
            return self._exact(x, mu, t, spks, cond, caches, chunk_masks)
        pad = shape.frames - frames
        x_in, mu_in, cond_in = (F.pad(v, (0, pad)) for v in (x, mu, cond))
        bias, extra = self._padded_positions(starts, rows, shape, frames, chunk_masks, x)
        conv, kv = pack_for_step(caches, rows, self.layout, x, shape.keys, room=shape.frames)
        inputs: list[StepInput] = [x_in, mu_in, t, spks, cond_in, conv, kv, bias, *extra]
        outputs = self.steps.run(shape.rows, inputs, borrowed=KV_NEW)  # stored into the contexts below
        velocity, conv_out, kv_new = outputs if outputs is not None else self.module(*as_tensors(inputs))
        kv_new = kv_new.narrow(4, 0, frames)
        unpack_caches(caches, rows, self.layout, conv_out.to(x.dtype), kv_new.to(x.dtype))
        return velocity[:, :, :frames].to(x.dtype)

    def _padded_positions(
        self, starts: list[int], rows: int, shape: StepShape, frames: int, chunk_masks: bool, like: Tensor
    ) -> tuple[Tensor, list[Tensor]]:
        """The call's position-only inputs (attention bias; conv tail index and, for the DiT, rotary
        angles), made once for the 10 Euler steps of a chunk: they share every position."""
        key = (tuple(starts), rows, shape, frames, chunk_masks, like.dtype, like.device)
        if key != self._positions_key or self._positions is None:
            chunk = self.layout.chunk_frames if chunk_masks else None
            bias = attention_bias(starts, rows, shape.frames, shape.keys, chunk, like.dtype, frames)
            width, batch = self.layout.conv_width, rows * len(starts)
            tail = (torch.arange(width, device=like.device) + frames).expand(batch, width)
            rope = self.module.rope(starts, rows, shape.frames, like.dtype)
            self._positions, self._positions_key = (to_device(bias, like.device), [tail, *rope]), key
        return self._positions

    def _exact(
        self,
        x: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        caches: list[EstimatorCache],
        chunk_masks: bool,
    ) -> Tensor:
        """The eager step at the call's exact shapes (outside every bucket)."""
        rows = x.shape[0] // len(caches)
        conv, kv, bias = pack_caches(caches, rows, x.shape[2], self.layout, chunk_masks, x)
        kv = F.pad(kv, (0, 0, 0, x.shape[2]))  # room for the new frames
        rope = self.module.rope([cache.frames for cache in caches], rows, x.shape[2], x.dtype)
        velocity, conv_out, kv_new = self.module(x, mu, t, spks, cond, conv, kv, bias, None, *rope)
        unpack_caches(caches, rows, self.layout, conv_out.to(x.dtype), kv_new.to(x.dtype))
        return velocity.to(x.dtype)

    @torch.inference_mode()
    def run(self, inputs: dict[str, Tensor]) -> Outputs:
        """The packed graph inputs of `INPUT_NAMES` (exact frames and keys): padded into their bucket and
        replayed, the outputs cut back; eagerly at their shapes outside every bucket."""
        rows, frames = inputs["x"].shape[0], inputs["x"].shape[2]
        keys = inputs["kv_cache"].shape[4]
        shape = self.buckets.shape(rows, frames, keys)
        ordered = [inputs[name] for name in INPUT_NAMES]
        if shape is None:
            self.steps.stats.eager += 1
            ordered[6] = F.pad(ordered[6], (0, 0, 0, frames))  # kv_cache: room for the new frames
            return self.module(*ordered)
        pad_frames, pad_keys = shape.frames - frames, shape.keys - keys
        x, mu, t, spks, cond, conv, kv, bias = ordered
        x, mu, cond = (F.pad(v, (0, pad_frames)) for v in (x, mu, cond))
        kv = F.pad(kv, (0, 0, 0, pad_keys + shape.frames))  # and room for the new frames
        cached, new = bias[..., :keys], bias[..., keys:]
        hidden = (0, 0, 0, pad_frames)  # padded queries see what the real ones see; padded keys nobody
        bias = torch.cat(
            [F.pad(cached, hidden), F.pad(cached.new_full((*cached.shape[:3], pad_keys), MASK_BIAS), hidden),
             F.pad(F.pad(new, (0, pad_frames), value=MASK_BIAS), hidden)],
            dim=3,
        )  # fmt: skip
        width = self.layout.conv_width
        tail = (torch.arange(width, device=x.device) + frames).expand(rows, width)
        step_inputs = [x, mu, t, spks, cond, conv, kv, bias, tail]
        outputs = self.steps.run(shape.rows, step_inputs)
        velocity, conv_out, kv_new = outputs if outputs is not None else self.module(*step_inputs)
        return velocity[:, :, :frames], conv_out, kv_new.narrow(4, 0, frames)

    @torch.inference_mode()
    def warm(self, rows: list[int], frames: list[int], keys: list[int], like: Tensor) -> int:
        """Capture the buckets of every (rows, frames, keys) given (start-up, before the engine says
        ready); returns how many are captured now. `like`: a tensor of the estimator's dtype and device."""
        layout, before = self.layout, self.steps.stats.captures
        for r in sorted(rows, reverse=True):  # the largest first: the smaller buckets' inputs are views
            for f in sorted(frames, reverse=True):
                for k in sorted(keys, reverse=True):
                    shape = self.buckets.shape(r, f, k)
                    if shape is None or (shape.rows, shape.frames, shape.keys) != (r, f, k):
                        continue
                    zeros = like.new_zeros
                    inputs = [
                        zeros(r, 80, f), zeros(r, 80, f), zeros(r), zeros(r, 80), zeros(r, 80, f),
                        zeros(r, layout.conv_channels, layout.conv_width),
                        zeros(layout.attention_slots, 2, r, layout.heads, k + f, layout.head_dim),
                        zeros(r, 1, f, k + f),
                        (torch.arange(layout.conv_width, device=like.device) + f).expand(r, -1),
                    ]  # fmt: skip
                    if self.module.takes_rope:
                        inputs += [zeros(r, f, layout.head_dim), zeros(r, f, layout.head_dim)]
                    if self.steps.run(r, inputs) is None and self.steps.stats.failed is not None:
                        return self.steps.stats.captures - before
        return self.steps.stats.captures - before
