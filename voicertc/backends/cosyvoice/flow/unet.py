"""The CFM velocity estimator (`CausalConditionalDecoder`), a one-level causal UNet, chunk-incremental.

Input channels [x, mu, speaker, cond] (4 x 80) -> down block (causal resnet + transformer blocks +
causal conv) -> mid blocks (resnet + transformer blocks) -> up block on [x, skip] -> causal final block
-> 1x1 projection to 80 mel bins. Causal convs only look left and attention uses the 50-frame chunk
mask anchored at the prompt start, so new frames need only `EstimatorCache` (each conv's last 2 input
frames, each attention's keys/values) from earlier chunks.

Batching: rows come in groups (one group = one utterance's CFG pair at one Euler step); every group has
its own cache and start frame, and all groups run the convs / projections as one batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voicertc.backends.cosyvoice.flow.config import EstimatorConfig
from voicertc.backends.cosyvoice.flow.encoder import chunk_attention_mask
from voicertc.backends.cosyvoice.flow.kv import KVCache, two_segment_sdpa
from voicertc.backends.cosyvoice.flow.qkv import init_qkv, project_heads
from voicertc.engine.parts import Parts, run_to_end

EstimatorParts = Parts[Tensor]  # one estimator forward, a part per next(); returns the velocity

GROW_FRAMES = 128  # a packed context's K/V room grows by a quarter at least, in steps of this many frames


class _KVBuffer:
    """Who may append to a packed K/V tensor in place: the one view that holds every frame written."""

    def __init__(self) -> None:
        self.frames = 0  # frames written into the tensor so far
        self.writer: object | None = None


@dataclass
class PackedCache:
    """A row group's whole context as two tensors, the form graph runners read and write
    (`flow.graph`): every conv's tail side by side [rows, C_sum, k-1] and every attention's K/V
    [A, 2, rows, heads, frames, head_dim]: a read-only `prefix` (frames [0, P), or none) and the view's
    own frames [P, frames) in `kv` (at [0, frames - P), with spare room). One op per call packs a group,
    one copy stores its new frames: no per-layer work on the host.

    Append-only sharing: `share` hands out a view of the same tensors. Frames a view holds never change,
    so a view may append in place only while it is its tensor's writer (or no one has written past its
    frames yet); another view keeps what it holds as its read-only prefix (a view, never copied) and
    appends to a tensor of its own. So a batch member's state saved for a retry costs nothing, and the
    utterances sharing a voice's prompt context read it where it is: on a GPU a 3 s prompt's context is
    ~345 MB per utterance in bf16, and this memory bounds how many utterances stream at once. The own
    room grows by a quarter (at least `GROW_FRAMES`)."""

    conv: Tensor
    kv: Tensor
    frames: int  # every frame: prefix and own
    conv_slots: tuple[tuple[int, int], ...]  # conv slot -> (channel offset, channels) in `conv`
    buffer: _KVBuffer = field(default_factory=_KVBuffer)
    prefix: Tensor | None = None  # [A, 2, rows, H, P, Dh]: frames [0, P), read-only

    def __post_init__(self) -> None:
        self.buffer.frames = max(self.buffer.frames, self.own_frames)

    @property
    def prefix_frames(self) -> int:
        return 0 if self.prefix is None else self.prefix.shape[4]

    @property
    def own_frames(self) -> int:
        return self.frames - self.prefix_frames

    def _writable(self) -> bool:
        buffer = self.buffer
        return buffer.writer is self or (buffer.writer is None and buffer.frames == self.own_frames)

    def reserve(self, frames: int) -> None:
        """Room for `frames` frames in all (prefix included), in a tensor this view may append to."""
        if self._writable():
            if frames - self.prefix_frames > self.kv.shape[4]:
                self._move(frames - self.prefix_frames)
            self.buffer.writer = self
            return
        if self.prefix is None:  # what this view holds stays where it is, as its read-only prefix
            self.prefix = self.kv[:, :, :, :, : self.frames] if self.frames else None
            self.kv = self.kv.new_zeros(*self.kv.shape[:4], _room(frames - self.frames, 0), self.kv.shape[5])
            self.buffer = _KVBuffer()
            self.buffer.writer = self
            return
        self._move(frames - self.prefix_frames)

    def _move(self, own_needed: int) -> None:
        """Own frames into a tensor of this view's own with room for `own_needed` (one copy)."""
        capacity = self.kv.shape[4]
        if own_needed > capacity:
            capacity = _room(own_needed, capacity)
        own = self.own_frames
        grown = self.kv.new_zeros(*self.kv.shape[:4], capacity, self.kv.shape[5])
        grown[:, :, :, :, :own] = self.kv[:, :, :, :, :own]
        self.kv, self.buffer = grown, _KVBuffer()
        self.buffer.frames, self.buffer.writer = own, self

    def store(self, conv: Tensor, kv_new: Tensor) -> None:
        """The call's new conv tails (replaced) and K/V frames (appended), [A, 2, rows, H, T, Dh]."""
        new = kv_new.shape[4]
        self.reserve(self.frames + new)
        own = self.own_frames
        self.kv[:, :, :, :, own : own + new] = kv_new
        self.conv = conv
        self.frames += new
        self.buffer.frames = self.own_frames

    def context(self, frames: int) -> Tensor:
        """K/V of frames [0, frames) as one tensor [A, 2, rows, H, frames, Dh] (a view without a prefix;
        frames past `self.frames` are whatever the room holds: callers hide them). After `reserve`."""
        own = self.kv[:, :, :, :, : frames - self.prefix_frames]
        return own if self.prefix is None else torch.cat([self.prefix, own], dim=4)

    def share(self) -> PackedCache:
        """Another view of the same context (append-only sharing, see the class)."""
        return PackedCache(self.conv, self.kv, self.frames, self.conv_slots, self.buffer, self.prefix)

    def nbytes(self) -> int:
        """Bytes of conv tails and own K/V frames (a prefix is counted where it is owned)."""
        filled = self.kv.numel() // self.kv.shape[4] * self.own_frames
        return self.conv.numel() * self.conv.element_size() + filled * self.kv.element_size()


def _room(needed: int, capacity: int) -> int:
    """Own K/V room for `needed` frames, grown from `capacity` by a quarter at least, in steps of
    `GROW_FRAMES`."""
    room = max(needed, capacity + capacity // 4, 1)
    return -(-room // GROW_FRAMES) * GROW_FRAMES


@dataclass
class EstimatorCache:
    """Left context of one row group: conv input tails [rows, C, k-1] (replaced, never written in
    place) and attention K/V caches [rows, heads, frames, head_dim], indexed by the slot numbers
    assigned at construction. A graph runner keeps the same context as one `PackedCache` instead
    (`packed`, the per-slot dicts then empty); the eager estimator unpacks it again (`unpack`)."""

    frames: int = 0
    conv_tails: dict[int, Tensor] = field(default_factory=dict)
    attention: dict[int, KVCache] = field(default_factory=dict)
    reserve_frames: int = 0  # first K/V buffer capacity
    packed: PackedCache | None = None

    def share(self) -> EstimatorCache:
        """An independent cache with the same context; copies no tensor data, now or when it is first
        written: the K/V so far become a read-only prefix (see `KVCache.fork`; a packed context is
        shared copy-on-write, `PackedCache.share`)."""
        attention = {slot: kv.fork() for slot, kv in self.attention.items()}
        packed = self.packed.share() if self.packed is not None else None
        return EstimatorCache(self.frames, dict(self.conv_tails), attention, self.reserve_frames, packed)

    def kv(self, slot: int) -> KVCache:
        if slot not in self.attention:
            self.attention[slot] = KVCache(reserve_frames=self.reserve_frames)
        return self.attention[slot]

    def unpack(self) -> None:
        """Back to the per-slot form from `packed` (the eager estimator after a graph runner)."""
        packed = self.packed
        if packed is None:
            return
        self.packed = None
        for slot, (offset, channels) in enumerate(packed.conv_slots):
            self.conv_tails[slot] = packed.conv[:, offset : offset + channels]
        own = packed.own_frames
        for slot in range(packed.kv.shape[0]):
            kv = KVCache(reserve_frames=self.reserve_frames)
            if packed.prefix is not None:  # read in place, as `KVCache.fork` does
                kv.prefix_keys, kv.prefix_values = packed.prefix[slot, 0], packed.prefix[slot, 1]
            if own:
                kv.append(packed.kv[slot, 0, :, :, :own], packed.kv[slot, 1, :, :, :own])
            self.attention[slot] = kv


class _Batch:
    """The caches of the row groups of one estimator call, seen as one batch."""

    def __init__(self, caches: list[EstimatorCache], rows_per_group: int, chunk_frames: int | None) -> None:
        self.caches = caches
        self.rows = rows_per_group
        self.chunk_frames = chunk_frames
        self.masks: dict[int, Tensor | None] = {}
        for cache in caches:  # a context a graph runner packed: per slot again
            cache.unpack()

    def conv_context(self, slot: int, x: Tensor, width: int) -> Tensor:
        """Prepend each group's cached left frames (zeros at the utterance start), keep the new tail."""
        tails = [c.conv_tails.get(slot) for c in self.caches]
        if all(t is None for t in tails):
            left = x.new_zeros(x.shape[0], x.shape[1], width)
        else:
            zeros = x.new_zeros(self.rows, x.shape[1], width)
            left = torch.cat([t if t is not None else zeros for t in tails], dim=0)
        padded = torch.cat([left, x], dim=2)
        for group, cache in enumerate(self.caches):
            cache.conv_tails[slot] = padded[group * self.rows : (group + 1) * self.rows, :, -width:]
        return padded

    def mask(self, group: int, query_len: int, device: torch.device) -> Tensor | None:
        start = self.caches[group].frames
        if start not in self.masks:
            self.masks[start] = chunk_attention_mask(start, query_len, self.chunk_frames, device)
        return self.masks[start]

    def attend(self, slot: int, q: Tensor, k: Tensor, v: Tensor, stacked_kv: Tensor | None = None) -> Tensor:
        # q, k, v: [B, H, Tq, Dh] for the new frames -> [B, H, Tq, Dh] over cached + new keys
        # (`stacked_kv`, k and v stacked, is for the captured path's one write)
        # (the new keys are written into the group's buffer; attention reads views of it and of a
        # forked cache's read-only prompt prefix: no copies)
        outs = []
        for group, cache in enumerate(self.caches):
            rows = slice(group * self.rows, (group + 1) * self.rows)
            kv = cache.kv(slot)
            keys, values = kv.append(k[rows], v[rows])
            mask = self.mask(group, q.shape[2], q.device)
            prefix = kv.prefix()
            if prefix is None:
                outs.append(F.scaled_dot_product_attention(q[rows], keys, values, attn_mask=mask))
                continue
            outs.append(two_segment_sdpa(q[rows], prefix, keys, values, mask))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


RowBatch = _Batch  # the public name (CosyVoice3's DiT runs on the same row groups and caches)


class CausalConv1d(nn.Conv1d):
    """Conv1d fed with its (kernel-1) previous input frames from the cache instead of zero padding."""

    slot = -1

    def forward(self, x: Tensor, batch: _Batch) -> Tensor:  # type: ignore[override]
        return super().forward(batch.conv_context(self.slot, x, self.kernel_size[0] - 1))


class CausalBlock1D(nn.Module):
    """Causal conv (k=3) -> LayerNorm over channels -> Mish; `block.0` / `block.2` as in the checkpoint."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.ModuleList([CausalConv1d(dim, dim_out, 3), nn.Identity(), nn.LayerNorm(dim_out)])

    def forward(self, x: Tensor, batch: _Batch) -> Tensor:
        h = self.block[0](x, batch)
        return F.mish(self.block[2](h.transpose(1, 2)).transpose(1, 2))


class CausalResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, time_emb: Tensor, batch: _Batch) -> Tensor:
        # x: [B, C_in, T], time_emb: [B, E] -> [B, C_out, T]
        h = self.block1(x, batch) + self.mlp(time_emb).unsqueeze(-1)
        return self.block2(h, batch) + self.res_conv(x)


class Attention(nn.Module):
    """Self-attention of the diffusers block: q/k/v without bias, out projection with bias."""

    slot = -1

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(0.0)])
        init_qkv(self)  # q/k/v as one matmul once `fuse_qkv` stacked them (the captured path)

    def forward(self, x: Tensor, batch: _Batch) -> Tensor:
        # x: [B, T, C] -> [B, T, C]
        q, k, v, stacked_kv = project_heads(self, x, self.heads, self.head_dim)
        out = batch.attend(self.slot, q, k, v, stacked_kv)
        return self.to_out[0](out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class GELUProj(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        self.net = nn.ModuleList([GELUProj(dim, dim * mult), nn.Dropout(0.0), nn.Linear(dim * mult, dim)])

    def forward(self, x: Tensor) -> Tensor:
        return self.net[2](self.net[0](x))


class BasicTransformerBlock(nn.Module):
    """LN -> self-attention -> residual -> LN -> GELU FFN -> residual (norm1 / norm3 as in Matcha)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: Tensor, batch: _Batch) -> Tensor:
        x = x + self.attn1(self.norm1(x), batch)
        return x + self.ff(self.norm3(x))


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, t: Tensor, scale: float = 1000.0) -> Tensor:
        # t: [B] in [0, 1] -> [B, dim]
        half = self.dim // 2
        freq = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
        angle = scale * t.unsqueeze(1) * freq.unsqueeze(0)
        return torch.cat([angle.sin(), angle.cos()], dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def _stage(dim_in: int, cfg: EstimatorConfig, tail: bool) -> nn.ModuleList:
    """[resnet, transformer blocks] (+ a causal conv for the down/up stages)."""
    c = cfg.channels
    blocks = nn.ModuleList(
        BasicTransformerBlock(c, cfg.num_heads, cfg.attention_head_dim) for _ in range(cfg.n_blocks)
    )
    parts: list[nn.Module] = [CausalResnetBlock1D(dim_in, c, cfg.time_embed_dim), blocks]
    if tail:
        parts.append(CausalConv1d(c, c, 3))
    return nn.ModuleList(parts)


def _parts(stage: nn.Module) -> nn.ModuleList:
    """A `_stage` (or its transformer blocks): nn.ModuleList is not generic, its items type as Module."""
    return cast(nn.ModuleList, stage)


class CausalConditionalDecoder(nn.Module):
    """Velocity v(x, t | mu, speaker, cond) for new frames, given the caches of earlier frames."""

    def __init__(self, cfg: EstimatorConfig) -> None:
        super().__init__()
        c = cfg.channels
        self.chunk_frames = cfg.static_chunk_size_frames
        self.time_embeddings = SinusoidalPosEmb(cfg.in_channels)
        self.time_mlp = TimestepEmbedding(cfg.in_channels, cfg.time_embed_dim)
        self.down_blocks = nn.ModuleList([_stage(cfg.in_channels, cfg, tail=True)])
        self.mid_blocks = nn.ModuleList(_stage(c, cfg, tail=False) for _ in range(cfg.num_mid_blocks))
        self.up_blocks = nn.ModuleList([_stage(2 * c, cfg, tail=True)])
        self.final_block = CausalBlock1D(c, c)
        self.final_proj = nn.Conv1d(c, cfg.out_channels, 1)
        conv_slot = attn_slot = 0
        for module in self.modules():
            if isinstance(module, CausalConv1d):
                module.slot, conv_slot = conv_slot, conv_slot + 1
            elif isinstance(module, Attention):
                module.slot, attn_slot = attn_slot, attn_slot + 1

    def _resnet_and_blocks(self, stage: nn.ModuleList, x: Tensor, t_emb: Tensor, batch: _Batch) -> Tensor:
        x = stage[0](x, t_emb, batch).transpose(1, 2)
        for block in _parts(stage[1]):
            x = block(x, batch)
        return x.transpose(1, 2)

    # the estimator signature the CFM solver calls: deliberately the same as dit.py's (v3)
    def forward(
        self,
        x: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        caches: list[EstimatorCache],
        chunk_masks: bool,
    ) -> Tensor:
        # x, mu, cond: [B, 80, T] new frames; t: [B]; spks: [B, 80]; B = len(caches) * rows -> [B, 80, T]
        return run_to_end(self.forward_parts(x, mu, t, spks, cond, caches, chunk_masks))

    def forward_parts(
        self,
        x: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        caches: list[EstimatorCache],
        chunk_masks: bool,
    ) -> EstimatorParts:
        """`forward` one stage per `next()` (down, each mid stage, up): the same operations in the same
        order, so the parts together compute it bit for bit; the velocity is the generator's return."""
        batch = _Batch(caches, x.shape[0] // len(caches), self.chunk_frames if chunk_masks else None)
        h, skip, t_emb = self._embed(x, mu, t, spks, cond)
        for stage in range(self.n_stages):
            h, skip = self._stage(stage, h, skip, t_emb, batch)
            yield
        out = self._project(h, batch)
        for cache in caches:
            cache.frames += x.shape[2]
        return out

    @property
    def n_stages(self) -> int:
        return 2 + len(self.mid_blocks)

    def forward_batch(
        self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, batch: Any
    ) -> Tensor:
        """The network on the new frames; `batch` supplies each causal conv's left context
        (`conv_context`) and each attention's cached keys (`attend`): `_Batch` here, a graph input
        packing for the ONNX export (`voicertc.backends.cosyvoice.accel.flow_onnx_export`)."""
        h, skip, t_emb = self._embed(x, mu, t, spks, cond)
        for stage in range(self.n_stages):
            h, skip = self._stage(stage, h, skip, t_emb, batch)
        return self._project(h, batch)

    def _embed(
        self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        # -> the down stage's input [B, 320, T] (also the skip until the down stage sets it), t_emb
        t_emb = self.time_mlp(self.time_embeddings(t).to(t.dtype))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[2]), cond], dim=1)
        return h, h, t_emb

    def _stage(self, stage: int, h: Tensor, skip: Tensor, t_emb: Tensor, batch: Any) -> tuple[Tensor, Tensor]:
        # stage 0: down (sets the skip), 1..n-2: mid, n-1: up (reads the skip) -> (h, skip)
        if stage == 0:
            down = _parts(self.down_blocks[0])
            skip = self._resnet_and_blocks(down, h, t_emb, batch)
            return down[2](skip, batch), skip
        if stage < self.n_stages - 1:
            return self._resnet_and_blocks(_parts(self.mid_blocks[stage - 1]), h, t_emb, batch), skip
        up = _parts(self.up_blocks[0])
        h = self._resnet_and_blocks(up, torch.cat([h, skip], dim=1), t_emb, batch)
        return up[2](h, batch), skip

    def _project(self, h: Tensor, batch: Any) -> Tensor:
        return self.final_proj(self.final_block(h, batch))
