"""The CosyVoice3 CFM velocity estimator (`DiT`), chunk-incremental like CosyVoice2's UNet.

Input [x, cond, mu, speaker] (4 x 80) -> linear -> causal conv position embedding (two grouped k=31
convs, left padded) -> AdaLN-zero transformer blocks (rotary on the first head, 50-frame chunk mask
anchored at the prompt start) -> AdaLN final norm -> linear to 80 mel bins. The convs only look left
and attention is chunk-causal, so new frames need only the `EstimatorCache` of earlier chunks (each
conv's last 30 input frames, each block's keys/values), exactly as for CosyVoice2 (`RowBatch`).

Rotary: positions are absolute frame indices of the utterance (prompt included); the stored
`rotary_embed.inv_freq` buffer is part of `flow.pt` and used as loaded, in float32 at any model dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voicertc.backends.cosyvoice.flow.config_v3 import (
    CONV_POS_GROUPS,
    CONV_POS_KERNEL,
    TIME_FREQ_DIM,
    DitConfig,
)
from voicertc.backends.cosyvoice.flow.qkv import init_qkv, project_qkv
from voicertc.backends.cosyvoice.flow.unet import EstimatorCache, EstimatorParts, RowBatch
from voicertc.engine.parts import run_to_end

_LN_EPS = 1e-6


def _rotate_half(x: Tensor) -> Tensor:
    # pairs (x0, x1) -> (-x1, x0) over the last dim (interleaved rotary)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first `cos.shape[-1]` channels of x [B, T, C] (the first head), keep the rest."""
    rot = cos.shape[-1]
    head, rest = x[..., :rot], x[..., rot:]
    return torch.cat((head * cos + _rotate_half(head) * sin, rest), dim=-1)


class SinusPositionEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, t: Tensor, scale: float = 1000.0) -> Tensor:
        # t: [B] -> [B, dim]
        half = self.dim // 2
        freq = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
        angle = scale * t.unsqueeze(1) * freq.unsqueeze(0)
        return torch.cat((angle.sin(), angle.cos()), dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, freq_dim: int = TIME_FREQ_DIM) -> None:
        super().__init__()
        self.time_embed = SinusPositionEmbedding(freq_dim)
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        return self.time_mlp(self.time_embed(t).to(t.dtype))


class StreamConv(nn.Conv1d):
    """Grouped conv fed with its cached (kernel-1) previous input frames instead of zero padding.

    `as_matmul` (`use_matmul_convs`) computes it as one batched matmul of the unfolded input
    (`grouped_conv1d_as_matmul`) instead of `F.conv1d`: the same sums in another order (fp32 within
    1e-5). On an H100 the DiT's 200-frame chunks cost ~1.2 s eager against 0.2 s for 300-frame ones,
    and these grouped k=31 convs' cuDNN algorithm is the suspect; `bench.gpu_flow_probe --v3` times
    both forms side by side (not yet run on a GPU: the default stays `F.conv1d`)."""

    slot = -1
    as_matmul = False

    def forward(self, x: Tensor, batch: RowBatch) -> Tensor:  # type: ignore[override]
        padded = batch.conv_context(self.slot, x, self.kernel_size[0] - 1)
        if self.as_matmul:
            return grouped_conv1d_as_matmul(padded, self.weight, self.bias, self.groups)
        return super().forward(padded)


def grouped_conv1d_as_matmul(x: Tensor, weight: Tensor, bias: Tensor | None, groups: int) -> Tensor:
    """`F.conv1d(x, weight, bias, groups=groups)` (stride 1, no padding) as one batched matmul:
    x [B, C, T + k - 1], weight [C_out, C / groups, k] -> [B, C_out, T]. The input's windows are a view
    (`unfold`), gathered once into [groups, B * T, C / groups * k] and multiplied by each group's weight
    [C / groups * k, C_out / groups] (cuBLAS, whatever T is)."""
    batch, channels, _ = x.shape
    out_channels, group_in, kernel = weight.shape
    group_out = out_channels // groups
    windows = x.unfold(2, kernel, 1)  # [B, C, T, k]
    frames = windows.shape[2]
    rows = windows.reshape(batch, groups, group_in, frames, kernel).permute(1, 0, 3, 2, 4)
    rows = rows.reshape(groups, batch * frames, group_in * kernel)
    w = weight.reshape(groups, group_out, group_in * kernel).transpose(1, 2)
    out = torch.bmm(rows, w).reshape(groups, batch, frames, group_out).permute(1, 0, 3, 2)
    out = out.reshape(batch, out_channels, frames)
    return out if bias is None else out + bias[None, :, None]


def use_matmul_convs(module: nn.Module, on: bool = True) -> int:
    """Switch every `StreamConv` under `module` to (or back from) the matmul form; how many."""
    convs = [m for m in module.modules() if isinstance(m, StreamConv)]
    for conv in convs:
        conv.as_matmul = on
    return len(convs)


class CausalConvPositionEmbedding(nn.Module):
    """`conv1.0` / `conv2.0` as in the checkpoint (index 1 is the Mish)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.ModuleList([StreamConv(dim, dim, CONV_POS_KERNEL, groups=CONV_POS_GROUPS)])
        self.conv2 = nn.ModuleList([StreamConv(dim, dim, CONV_POS_KERNEL, groups=CONV_POS_GROUPS)])

    def forward(self, x: Tensor, batch: RowBatch) -> Tensor:
        # x: [B, T, D] -> [B, T, D]
        h = F.mish(self.conv1[0](x.transpose(1, 2), batch))
        h = F.mish(self.conv2[0](h, batch))
        return h.transpose(1, 2)


class InputEmbedding(nn.Module):
    def __init__(self, cfg: DitConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.in_dim, cfg.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(cfg.dim)

    def forward(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor, batch: RowBatch) -> Tensor:
        # x, cond, mu: [B, T, 80], spks: [B, 80] -> [B, T, D]
        spks = spks.unsqueeze(1).expand(-1, x.shape[1], -1)
        h = self.proj(torch.cat([x, cond, mu, spks], dim=-1))
        return self.conv_pos_embed(h, batch) + h


class AdaLayerNormZero(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=_LN_EPS)

    def forward(self, x: Tensor, emb: Tensor) -> tuple[Tensor, ...]:
        shift, scale, gate, shift_ff, scale_ff, gate_ff = self.linear(F.silu(emb)).chunk(6, dim=1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None], gate, shift_ff, scale_ff, gate_ff


class AdaLayerNormZeroFinal(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=_LN_EPS)

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        scale, shift = self.linear(F.silu(emb)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


class DiTAttention(nn.Module):
    """q/k/v/out with bias; rotary on q and k before the head split (only the first head turns)."""

    slot = -1

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(0.0)])
        init_qkv(self)  # q/k/v as one matmul once `fuse_qkv` stacked them (the captured path)

    def _split(self, x: Tensor) -> Tensor:
        return x.view(x.shape[0], x.shape[1], self.heads, self.dim_head).transpose(1, 2)

    def forward(self, x: Tensor, batch: RowBatch, rope: tuple[Tensor, Tensor]) -> Tensor:
        # x: [B, T, D] -> [B, T, D]
        cos, sin = rope
        q_in, k_in, v_in = project_qkv(self, x)
        q = self._split(apply_rotary(q_in, cos, sin))
        k = self._split(apply_rotary(k_in, cos, sin))
        out = batch.attend(self.slot, q, k, self._split(v_in))
        return self.to_out[0](out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class FeedForward(nn.Module):
    """`ff.0.0` linear + GELU(tanh), `ff.2` linear (checkpoint names)."""

    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        inner = dim * mult
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")),
            nn.Dropout(0.0),
            nn.Linear(inner, dim),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, cfg: DitConfig) -> None:
        super().__init__()
        self.attn_norm = AdaLayerNormZero(cfg.dim)
        self.attn = DiTAttention(cfg.dim, cfg.heads, cfg.dim_head)
        self.ff_norm = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=_LN_EPS)
        self.ff = FeedForward(cfg.dim, cfg.ff_mult)

    def forward(self, x: Tensor, t_emb: Tensor, batch: RowBatch, rope: tuple[Tensor, Tensor]) -> Tensor:
        norm, gate, shift_ff, scale_ff, gate_ff = self.attn_norm(x, t_emb)
        x = x + gate.unsqueeze(1) * self.attn(norm, batch, rope)
        norm = self.ff_norm(x) * (1 + scale_ff[:, None]) + shift_ff[:, None]
        return x + gate_ff.unsqueeze(1) * self.ff(norm)


class RotaryEmbedding(nn.Module):
    """x-transformers' RotaryEmbedding: only the (checkpointed) `inv_freq` buffer.

    The angles are computed in float32 whatever the model's dtype, and `inv_freq` stays float32 when
    the module is cast (`_apply`): in bfloat16 the positions past 256 frames are not representable
    (600, 601 and 602 are one number) and a bf16 `inv_freq` moves the angle at frame 600 by radians.
    The caller casts cos/sin to the model's dtype (`DiT.rope`)."""

    inv_freq: Tensor  # registered buffer, float32

    def __init__(self, dim_head: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim_head, 2).float() / dim_head))
        self.register_buffer("inv_freq", inv_freq)

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        exact = self.inv_freq
        super()._apply(fn, recurse)
        if exact.dtype == torch.float32 and self.inv_freq.dtype != torch.float32:
            self.inv_freq = exact.to(device=self.inv_freq.device)  # moved, never rounded
        return self

    def cos_sin(self, start: int, frames: int) -> tuple[Tensor, Tensor]:
        # -> cos, sin: [T, dim_head] float32 for absolute positions start..start+frames-1 (pairs interleaved)
        inv_freq = self.inv_freq.float()
        positions = torch.arange(start, start + frames, device=inv_freq.device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        freqs = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        return freqs.cos(), freqs.sin()


class DiT(nn.Module):
    """Velocity v(x, t | mu, speaker, cond) for new frames, given the caches of earlier frames.

    Same call signature as CosyVoice2's `CausalConditionalDecoder`, so `CausalConditionalCFM` runs it."""

    def __init__(self, cfg: DitConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.chunk_frames = cfg.static_chunk_size_frames
        self.time_embed = TimestepEmbedding(cfg.dim)
        self.input_embed = InputEmbedding(cfg)
        self.rotary_embed = RotaryEmbedding(cfg.dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.depth))
        self.norm_out = AdaLayerNormZeroFinal(cfg.dim)
        self.proj_out = nn.Linear(cfg.dim, cfg.mel_dim)
        conv_slot = attn_slot = 0
        for module in self.modules():
            if isinstance(module, StreamConv):
                module.slot, conv_slot = conv_slot, conv_slot + 1
            elif isinstance(module, DiTAttention):
                module.slot, attn_slot = attn_slot, attn_slot + 1

    def rope(self, starts: list[int], rows: int, frames: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # -> cos, sin: [1 or B, T, dim_head], row group g (`rows` rows) at absolute frame starts[g]
        if len(set(starts)) == 1:
            cos, sin = self.rotary_embed.cos_sin(starts[0], frames)
            return cos[None].to(dtype), sin[None].to(dtype)
        parts = [self.rotary_embed.cos_sin(s, frames) for s in starts]
        cos = torch.stack([p[0] for p in parts]).repeat_interleave(rows, dim=0)
        sin = torch.stack([p[1] for p in parts]).repeat_interleave(rows, dim=0)
        return cos.to(dtype), sin.to(dtype)

    # the estimator signature the CFM solver calls: deliberately the same as unet.py's (v2)
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
        """`forward` one transformer block per `next()`, as unet.py's stages: the same operations in the
        same order; the velocity is the generator's return."""
        batch, rope = self._open(x, caches, chunk_masks)
        h, t_emb, rope = self._embed(x, mu, t, spks, cond, batch, rope)
        for block in self.transformer_blocks:
            h = block(h, t_emb, batch, rope)
            yield
        out = self.proj_out(self.norm_out(h, t_emb)).transpose(1, 2)
        for cache in caches:
            cache.frames += x.shape[2]
        return out

    def _open(
        self, x: Tensor, caches: list[EstimatorCache], chunk_masks: bool
    ) -> tuple[RowBatch, tuple[Tensor, Tensor]]:
        rows = x.shape[0] // len(caches)
        batch = RowBatch(caches, rows, self.chunk_frames if chunk_masks else None)
        return batch, self.rope([c.frames for c in caches], rows, x.shape[2], x.dtype)

    def forward_batch(
        self,
        x: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        batch: Any,
        rope: tuple[Tensor, Tensor],
    ) -> Tensor:
        """The network on a batch that answers its convs' and attentions' cache questions (the eager
        `RowBatch`, or the graph form's tensors: `flow.graph.StreamingEstimator`)."""
        h, t_emb, rope = self._embed(x, mu, t, spks, cond, batch, rope)
        for block in self.transformer_blocks:
            h = block(h, t_emb, batch, rope)
        return self.proj_out(self.norm_out(h, t_emb)).transpose(1, 2)

    def _embed(
        self,
        x: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        batch: Any,
        rope: tuple[Tensor, Tensor],
    ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        t_emb = self.time_embed(t)
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks, batch)
        return h, t_emb, (rope[0].to(h.dtype), rope[1].to(h.dtype))
