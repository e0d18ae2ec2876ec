"""The streaming flow estimator as a graph with explicit caches (ONNX Runtime / TensorRT runners).

The graph (`voicertc export onnx`, `accel.flow_onnx_export`) computes the velocity of a chunk's new
frames from tensors only:

    inputs   x, mu, cond [B, 80, T]; t [B]; spks [B, 80]
             conv_cache [B, C_sum, 2]            every causal conv's last 2 input frames, by slot
             kv_cache   [A, 2, B, H, L, Dh]      every attention's cached keys / values, by slot
             attn_bias  [B, 1, T, L + T]         0 = visible, MASK_BIAS = hidden
    outputs  velocity [B, 80, T]; conv_cache_out [B, C_sum, 2]; kv_new [A, 2, B, H, T, Dh]

B covers the CFG rows of several utterances at one Euler step (2 per utterance); their caches may hold
different numbers of frames, so L is the longest, the shorter ones padded and hidden by `attn_bias`
(which also carries the 50-frame chunk mask at each group's absolute position). `GraphEstimator` packs
our `EstimatorCache`s into these inputs and writes the outputs back, so a runner is a drop-in for the
eager `CausalConditionalDecoder` inside the CFM sampler: voices, forks and clones work unchanged.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voicertc.backends.cosyvoice.flow.dit import DiT, DiTAttention, StreamConv
from voicertc.backends.cosyvoice.flow.unet import (
    Attention,
    CausalConditionalDecoder,
    CausalConv1d,
    EstimatorCache,
    PackedCache,
)

logger = logging.getLogger(__name__)

MASK_BIAS = -1.0e4  # finite (fp16-safe: no -inf - -inf = NaN); exp(-1e4) is 0 in fp32 and fp16
INPUT_NAMES = ("x", "mu", "t", "spks", "cond", "conv_cache", "kv_cache", "attn_bias")
OUTPUT_NAMES = ("velocity", "conv_cache_out", "kv_new")


@dataclass(frozen=True)
class GraphLayout:
    """Where each cache lives in the packed tensors: conv slot -> (channel offset, channels)."""

    conv_slots: tuple[tuple[int, int], ...]
    attention_slots: int
    heads: int
    head_dim: int
    chunk_frames: int
    conv_width: int = 2

    @property
    def conv_channels(self) -> int:
        return sum(c for _, c in self.conv_slots)

    @staticmethod
    def of(estimator: nn.Module) -> GraphLayout:
        """The layout of CosyVoice2's UNet or CosyVoice3's DiT (the convs of one estimator share a width)."""
        convs: list[tuple[int, nn.Conv1d]]
        if isinstance(estimator, CausalConditionalDecoder):
            convs = sorted((m.slot, m) for m in estimator.modules() if isinstance(m, CausalConv1d))
            attns = [(m.heads, m.head_dim) for m in estimator.modules() if isinstance(m, Attention)]
        elif isinstance(estimator, DiT):
            convs = sorted((m.slot, m) for m in estimator.modules() if isinstance(m, StreamConv))
            attns = [(m.heads, m.dim_head) for m in estimator.modules() if isinstance(m, DiTAttention)]
        else:
            raise ValueError(f"the graph layout covers the UNet and the DiT, not {type(estimator).__name__}")
        widths = {m.kernel_size[0] - 1 for _, m in convs}
        if len(widths) != 1:
            raise ValueError(f"the graph layout needs one causal conv width, found {sorted(widths)}")
        slots, offset = [], 0
        for _, conv in convs:
            slots.append((offset, conv.in_channels))
            offset += conv.in_channels
        return GraphLayout(
            conv_slots=tuple(slots),
            attention_slots=len(attns),
            heads=attns[0][0],
            head_dim=attns[0][1],
            chunk_frames=estimator.chunk_frames,
            conv_width=widths.pop(),
        )


def attention_bias(
    starts: list[int],
    rows: int,
    frames: int,
    padded: int,
    chunk: int | None,
    dtype: torch.dtype,
    real_frames: int | None = None,
) -> Tensor:
    """[B, 1, T, padded + T]: group g's first `starts[g]` cached keys are real, the rest padding;
    query i (absolute starts[g] + i) sees key at absolute j iff j < (abs_i // chunk + 1) * chunk. With
    `real_frames`, the new frames past it are padding too (a static-shape step's padded chunk)."""
    new_real = frames if real_frames is None else real_frames
    biases = []
    for start in starts:
        key_abs = torch.cat([torch.arange(padded), start + torch.arange(frames)])
        real = torch.cat([torch.arange(padded) < start, torch.arange(frames) < new_real])
        visible = real[None, :].expand(frames, -1)
        if chunk is not None:
            query_abs = start + torch.arange(frames)
            limit = (torch.div(query_abs, chunk, rounding_mode="floor") + 1) * chunk
            visible = visible & (key_abs[None, :] < limit[:, None])
        bias = torch.zeros(frames, padded + frames, dtype=dtype).masked_fill(~visible, MASK_BIAS)
        biases.append(bias[None, None].expand(rows, 1, -1, -1))
    return torch.cat(biases, dim=0)


def _group_keys(cache: EstimatorCache, slot: int) -> tuple[Tensor, Tensor] | None:
    kv = cache.attention.get(slot)
    if kv is None or kv.frames == 0:
        return None
    keys = [] if kv.prefix_keys is None else [kv.prefix_keys]
    values = [] if kv.prefix_values is None else [kv.prefix_values]
    if kv.length and kv.keys is not None and kv.values is not None:
        keys.append(kv.keys[:, :, : kv.length])
        values.append(kv.values[:, :, : kv.length])
    return torch.cat(keys, dim=2), torch.cat(values, dim=2)


def packed_context(cache: EstimatorCache, rows: int, layout: GraphLayout, like: Tensor) -> PackedCache:
    """The group's context as one `PackedCache`: made from the per-slot form the first time a graph
    runner meets the cache (a voice's prompt, say), then kept and written in that form."""
    if cache.packed is not None:
        return cache.packed
    conv = like.new_zeros(rows, layout.conv_channels, layout.conv_width)
    for slot, (offset, channels) in enumerate(layout.conv_slots):
        tail = cache.conv_tails.get(slot)
        if tail is not None:
            conv[:, offset : offset + channels] = tail
    kv = like.new_zeros(layout.attention_slots, 2, rows, layout.heads, max(64, cache.frames), layout.head_dim)
    for slot in range(layout.attention_slots):
        got = _group_keys(cache, slot)
        if got is not None:
            n = got[0].shape[2]
            kv[slot, 0, :, :, :n] = got[0]
            kv[slot, 1, :, :, :n] = got[1]
    cache.packed = PackedCache(conv, kv, cache.frames, layout.conv_slots)
    cache.conv_tails, cache.attention = {}, {}
    return cache.packed


def pack_caches(
    caches: list[EstimatorCache],
    rows: int,
    frames: int,
    layout: GraphLayout,
    chunk_masks: bool,
    like: Tensor,
    keys: int = 1,
    real_frames: int | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(conv_cache, kv_cache, attn_bias) for the row groups `caches` (each `rows` rows); the cached keys
    are padded to `keys` at least (hidden by the bias), and the new frames past `real_frames` too.
    One op per input whatever the layers: views of the packed contexts, concatenated across groups."""
    packed = [packed_context(cache, rows, layout, like) for cache in caches]
    starts = [cache.frames for cache in caches]
    padded = max(1, keys, *starts)  # at least one (hidden) key: no zero-sized graph inputs
    for p in packed:
        p.reserve(padded)
    kv_views = [p.context(padded) for p in packed]  # past each group's frames: finite, hidden
    kv = kv_views[0] if len(packed) == 1 else torch.cat(kv_views, dim=2)
    conv = packed[0].conv if len(packed) == 1 else torch.cat([p.conv for p in packed], dim=0)
    if bias is None:  # (a caller may pass the bias it made for the same call: every Euler step shares it)
        chunk = layout.chunk_frames if chunk_masks else None
        bias = attention_bias(starts, rows, frames, padded, chunk, like.dtype, real_frames).to(like.device)
    return conv.to(like.dtype), kv.to(like.dtype), bias


@dataclass(frozen=True)
class PackedKV:
    """A call's `kv_cache` input [A, 2, B, H, keys, Dh] not made yet (`accel.captured.FillsBuffer`): each
    group's frames (its read-only prefix, then its own) are written straight into the buffer the step
    reads, once; `pack_caches` makes the whole tensor by concatenating views, which a static step then
    copies again. Key positions past a group's frames keep what the buffer holds (finite values written
    earlier, or zeros), hidden by the attention bias as the padding of `pack_caches` is."""

    groups: tuple[PackedCache, ...]
    rows: int  # rows per group
    keys: int  # padded cached keys (>= every group's frames)
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        a, two, rows, heads, _, dh = self.groups[0].kv.shape
        return torch.Size((a, two, rows * len(self.groups), heads, self.keys, dh))

    @property
    def device(self) -> torch.device:
        return self.groups[0].kv.device

    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def fill(self, out: Tensor) -> None:
        """Write every group's frames into `out` (of `shape`); positions past them are left as they are."""
        for g, packed in enumerate(self.groups):
            group = out.narrow(2, g * self.rows, self.rows)
            start = 0
            if packed.prefix is not None:
                start = packed.prefix_frames
                group.narrow(4, 0, start).copy_(packed.prefix)
            own = packed.frames - start
            if own:
                group.narrow(4, start, own).copy_(packed.kv.narrow(4, 0, own))

    def tensor(self) -> Tensor:
        out = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self.fill(out)
        return out


def pack_for_step(
    caches: list[EstimatorCache], rows: int, layout: GraphLayout, like: Tensor, keys: int, room: int = 0
) -> tuple[Tensor, PackedKV]:
    """(conv_cache, kv_cache) of `pack_caches` for a static step: the conv tails made (a few frames a
    conv), the keys and values left to be written into the step's own buffer (`PackedKV`), `room` key
    positions past the padded cached ones (`StreamingEstimator.with_kv_room`)."""
    packed = [packed_context(cache, rows, layout, like) for cache in caches]
    padded = max(1, keys, *(cache.frames for cache in caches))
    conv = packed[0].conv if len(packed) == 1 else torch.cat([p.conv for p in packed], dim=0)
    return conv.to(like.dtype), PackedKV(tuple(packed), rows, padded + room, like.dtype)


def unpack_caches(
    caches: list[EstimatorCache], rows: int, layout: GraphLayout, conv_out: Tensor, kv_new: Tensor
) -> None:
    """Store a call's new conv tails and keys/values in each group's packed context."""
    frames = kv_new.shape[4]
    for g, cache in enumerate(caches):
        group = slice(g * rows, (g + 1) * rows)
        packed = packed_context(cache, rows, layout, conv_out)
        packed.store(conv_out[group], kv_new[:, :, group])
        cache.frames += frames


class _GraphBatch:
    """What the estimator's convs and attentions ask of a batch, answered from graph inputs."""

    def __init__(
        self,
        layout: GraphLayout,
        conv_cache: Tensor,
        kv_cache: Tensor,
        attn_bias: Tensor,
        tail_index: Tensor | None = None,
        kv_room: bool = False,
    ) -> None:
        self.layout = layout
        self.conv_cache, self.kv_cache, self.attn_bias = conv_cache, kv_cache, attn_bias
        self.tail_index = tail_index  # [B, width]: where each row's real frames end (padded chunks)
        self.kv_room = kv_room  # kv_cache ends with room for the new frames (`StreamingEstimator`)
        self.new_tails: dict[int, Tensor] = {}
        self.new_kv: dict[int, tuple[Tensor, Tensor]] = {}

    def conv_context(self, slot: int, x: Tensor, width: int) -> Tensor:
        offset, channels = self.layout.conv_slots[slot]
        padded = torch.cat([self.conv_cache[:, offset : offset + channels, -width:], x], dim=2)
        if self.tail_index is None:
            self.new_tails[slot] = padded[:, :, -width:]
        else:  # the last `width` real frames: index [width + real - width, width + real) of `padded`
            index = self.tail_index[:, None, :].expand(-1, padded.shape[1], -1)
            self.new_tails[slot] = padded.gather(2, index)
        return padded

    def attend(self, slot: int, q: Tensor, k: Tensor, v: Tensor, stacked_kv: Tensor | None = None) -> Tensor:
        # q, k, v: [B, H, T, Dh] -> [B, H, T, Dh] over [cached ++ new] keys; plain softmax attention;
        # stacked_kv: k and v as one [2, B, H, T, Dh] view where one projection made both (`flow.qkv`)
        self.new_kv[slot] = (k, v)
        if self.kv_room:  # the new frames written into the room the input keeps for them: no join
            keys, values = self.kv_cache[slot, 0], self.kv_cache[slot, 1]
            cached = keys.shape[2] - k.shape[2]
            if stacked_kv is not None:  # k and v side by side in the stacked projection: one copy
                self.kv_cache[slot].narrow(3, cached, k.shape[2]).copy_(stacked_kv)
            else:
                keys.narrow(2, cached, k.shape[2]).copy_(k)
                values.narrow(2, cached, v.shape[2]).copy_(v)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.attn_bias.to(q.dtype))
        keys = torch.cat([self.kv_cache[slot, 0], k], dim=2)
        values = torch.cat([self.kv_cache[slot, 1], v], dim=2)
        scores = (q @ keys.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])) + self.attn_bias
        return scores.softmax(dim=-1) @ values


class StreamingEstimator(nn.Module):
    """The estimator (CosyVoice2's UNet or CosyVoice3's DiT) with its caches as tensors (the graph of
    `voicertc export onnx` for the UNet; the captured static-shape step for both). The DiT also takes
    its rotary angles as inputs (`rope_cos`, `rope_sin` [B, T, Dh]: each row at its absolute frame)."""

    def __init__(self, estimator: nn.Module, kv_room: bool = False) -> None:
        super().__init__()
        self.estimator = estimator
        self.layout = GraphLayout.of(estimator)
        self.takes_rope = isinstance(estimator, DiT)
        self.kv_room = kv_room

    def with_kv_room(self) -> StreamingEstimator:
        """The static step's form of the same estimator: `kv_cache` [A, 2, B, H, L + T, Dh] keeps room
        for the chunk's T new frames at its end, which each attention writes there (the input is a
        scratch buffer: a static step's own) and attends over in one fused kernel, instead of joining
        the cached keys to the new ones (a copy of the whole history per attention per Euler step)."""
        return self if self.kv_room else StreamingEstimator(self.estimator, kv_room=True)

    def forward(
        self,
        x: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        conv_cache: Tensor,
        kv_cache: Tensor,
        attn_bias: Tensor,
        tail_index: Tensor | None = None,
        rope_cos: Tensor | None = None,
        rope_sin: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`tail_index` [B, width] (static-shape steps only): the chunk's frames are padded, row b's real
        ones end at `tail_index[b, -1] + 1 - width`; the new conv tails are taken there."""
        batch = _GraphBatch(self.layout, conv_cache, kv_cache, attn_bias, tail_index, self.kv_room)
        if isinstance(self.estimator, DiT):
            if rope_cos is None or rope_sin is None:
                raise ValueError("the DiT's graph form takes rope_cos and rope_sin")
            velocity = self.estimator.forward_batch(x, mu, t, spks, cond, batch, (rope_cos, rope_sin))
        else:
            unet: Any = self.estimator
            velocity = unet.forward_batch(x, mu, t, spks, cond, batch)
        conv_out = torch.cat([batch.new_tails[s] for s in range(len(self.layout.conv_slots))], dim=1)
        if self.kv_room:  # every attention wrote its new frames into the room: they are the output
            frames = x.shape[2]
            return velocity, conv_out, kv_cache.narrow(4, kv_cache.shape[4] - frames, frames)
        kv_new = torch.stack(
            [torch.stack(batch.new_kv[s]) for s in range(self.layout.attention_slots)]
        )  # [A, 2, B, H, T, Dh]
        return velocity, conv_out, kv_new

    def rope(self, starts: list[int], rows: int, frames: int, dtype: torch.dtype) -> list[Tensor]:
        """The extra inputs of a call: the DiT's rotary angles [B, T, Dh] (none for the UNet)."""
        if not isinstance(self.estimator, DiT):
            return []
        cos, sin = self.estimator.rope(starts, rows, frames, dtype)
        batch = rows * len(starts)
        return [cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)]


class GraphEstimator:
    """Drop-in for `CausalConditionalDecoder.forward` running the exported graph; `run` is the runtime."""

    def __init__(self, layout: GraphLayout) -> None:
        self.layout = layout

    def run(self, inputs: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def key_capacity(self, rows: int, frames: int, starts: list[int]) -> int:
        """Cached key frames to pack for a call (at least the longest group's; a runner with static
        shapes rounds up to its bucket)."""
        return max(1, *starts)

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
        rows = x.shape[0] // len(caches)
        keys = self.key_capacity(x.shape[0], x.shape[2], [cache.frames for cache in caches])
        conv, kv, bias = pack_caches(caches, rows, x.shape[2], self.layout, chunk_masks, x, keys)
        inputs = dict(zip(INPUT_NAMES, (x, mu, t, spks, cond, conv, kv, bias), strict=True))
        velocity, conv_out, kv_new = self.run(inputs)
        unpack_caches(caches, rows, self.layout, conv_out.to(x.dtype), kv_new.to(x.dtype))
        return velocity.to(x.dtype)


class OnnxRuntimeEstimator(GraphEstimator):
    """The exported estimator on ONNX Runtime (CPU by default)."""

    def __init__(self, path: str | Path, layout: GraphLayout, threads: int = 0) -> None:
        super().__init__(layout)
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # shared CPU: no busy wait
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        logger.info("onnxruntime estimator from %s", path)

    def run(self, inputs: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        feeds = {k: np.ascontiguousarray(v.detach().float().cpu().numpy()) for k, v in inputs.items()}
        velocity, conv_out, kv_new = self.session.run(list(OUTPUT_NAMES), feeds)
        device = inputs["x"].device
        return tuple(torch.from_numpy(a).to(device) for a in (velocity, conv_out, kv_new))  # type: ignore[return-value]
