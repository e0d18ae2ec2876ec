"""The static, slot-based K/V cache of the speech LLM's Qwen2 backbone (`SlotKV`, one `KVSlot` a row).

Runs on the engine thread. `SlotKV` preallocates keys/values for `slots` utterances x `capacity`
positions, one [slots, kv_heads, capacity, head_dim] tensor per layer (a new position is written into
its layer's tensor in place, which a compiled step keeps in place too: writes into a view of one
stacked tensor became a copy of the whole layer under `torch.compile`). Each utterance holds one
`KVSlot` (its row and its own length) for the life of its LLM session. `SlotKV.forward` runs the
Qwen2 layers for several slots at once with ragged positions: each row's new keys/values are written
at that row's length, and each query attends only to its own row's first `length + t + 1` positions
(a boolean mask), so a batch of utterances at different positions computes exactly what each would
alone.

Shapes stay static while nothing outgrows the pool (slots and capacity double when they must, which is
what a CUDA-graph capture per batch bucket keys on, `llm.graphs`). The transformers modules are used for
their weights and their RMSNorm / MLP / rotary code; only the attention over the slot cache is ours.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin, DynamicCache
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2Attention,
    Qwen2DecoderLayer,
    Qwen2Model,
    apply_rotary_pos_emb,
)

from voicertc.backends.cosyvoice.accel.staging import to_device

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class KVSlot:
    """One utterance's row of a `SlotKV`; `length` = positions filled. Released exactly once."""

    pool: SlotKV
    index: int
    length: int = 0
    released: bool = False

    def feed(self, embeds: Tensor) -> Tensor:
        """Run `embeds` [1, T, H] on this row; the hidden states [1, T, H] after the final norm."""
        return self.pool.forward([self], embeds)

    def load(self, cache: DynamicCache) -> None:
        """Copy a transformers cache (a voice's prefix) into this row, replacing what it held."""
        self.pool.load(self, cache)

    def get_seq_length(self) -> int:
        return self.length

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool.free(self)


class SlotKV:
    """The static K/V pool of one backbone (`Qwen2ForCausalLM.model`). Owned by the engine thread."""

    def __init__(
        self,
        backbone: Qwen2Model,
        slots: int = 16,
        capacity: int = 1024,
        fused: bool | None = None,
    ) -> None:
        cfg = backbone.config
        self.backbone = backbone
        self.layers = int(cfg.num_hidden_layers)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        weight = backbone.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        # fewer, larger kernels per layer where launches dominate (a GPU); None = on CUDA only
        use_fused = self.device.type == "cuda" if fused is None else fused
        self.fused = [FusedLayer.of(layer) for layer in self._decoder_layers()] if use_fused else None
        self.keys = self._zeros(slots, capacity)  # per layer [slots, kv_heads, capacity, head_dim]
        self.values = self._zeros(slots, capacity)
        self._free = list(range(slots - 1, -1, -1))
        self.grows = 0

    def _zeros(self, slots: int, capacity: int) -> list[Tensor]:
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        # ordinary tensors even when a step grows the pool under inference mode: the same kind of
        # tensor before and after a growth (a compiled step guards on it, and would compile again)
        with torch.inference_mode(False):
            return [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.layers)]

    @property
    def k(self) -> Tensor:
        """Every layer's keys stacked [layers, slots, kv_heads, capacity, head_dim]: a copy (inspection)."""
        return torch.stack(self.keys)

    @property
    def v(self) -> Tensor:
        """Every layer's values stacked, like `k`: a copy."""
        return torch.stack(self.values)

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def in_use(self) -> int:
        return self.slots - len(self._free)

    def acquire(self) -> KVSlot:
        """A free row (the pool doubles its slots when none is left)."""
        if not self._free:
            self._resize(self.slots * 2, self.capacity)
        return KVSlot(self, self._free.pop())

    def free(self, slot: KVSlot) -> None:
        self._free.append(slot.index)

    def _resize(self, slots: int, capacity: int) -> None:
        old_slots, old_cap = self.slots, self.capacity
        keys, values = self._zeros(slots, capacity), self._zeros(slots, capacity)
        for new, old in zip(keys + values, self.keys + self.values, strict=True):
            new[:old_slots, :, :old_cap] = old
        self.keys, self.values = keys, values
        self._free = list(range(slots - 1, old_slots - 1, -1)) + self._free
        self.grows += 1
        logger.info("LLM slot cache grown to %d slots x %d positions", slots, capacity)

    def _ensure_capacity(self, needed: int) -> None:
        if needed > self.capacity:
            capacity = self.capacity
            while capacity < needed:
                capacity *= 2
            self._resize(self.slots, capacity)

    def load(self, slot: KVSlot, cache: DynamicCache) -> None:
        length = cache.get_seq_length()
        self._ensure_capacity(length)
        for i, layer in enumerate(cache.layers):
            if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
                raise ValueError(f"layer {i} of the prefix cache holds no keys/values")
            self.keys[i][slot.index, :, :length] = layer.keys[0]
            self.values[i][slot.index, :, :length] = layer.values[0]
        slot.length = length

    @property
    def generation(self) -> int:
        """Changes whenever the K/V tensors are reallocated (a captured graph holds their addresses)."""
        return self.grows

    def ensure_capacity(self, needed: int) -> None:
        """Room for `needed` positions per row (the pool doubles its capacity when it must)."""
        self._ensure_capacity(needed)

    @torch.inference_mode()
    def forward(self, rows: list[KVSlot], embeds: Tensor) -> Tensor:
        """One forward of `embeds` [B, T, H] (row b on `rows[b]`); each row's length grows by T."""
        if len(rows) != embeds.shape[0]:
            raise ValueError(f"{len(rows)} slots for a batch of {embeds.shape[0]}")
        index, positions, span = self._place(rows, embeds.shape[1])
        hidden = self.run(index, positions, embeds, span)
        for r in rows:
            r.length += embeds.shape[1]
        return hidden

    def forward_parts(self, rows: list[KVSlot], embeds: Tensor) -> Generator[None, None, Tensor]:
        """`forward` one decoder layer per `next()` (a long prompt within an engine unit's budget): the
        same operations in the same order; the hidden states are the generator's return. The rows'
        lengths grow at the end; nothing else may feed them in between (the pool may grow: every layer
        reads the current K/V tensors, and a resize copies what is written)."""
        if len(rows) != embeds.shape[0]:
            raise ValueError(f"{len(rows)} slots for a batch of {embeds.shape[0]}")
        index, positions, span = self._place(rows, embeds.shape[1])
        hidden, step = self._inputs(index, positions, embeds, span)
        for i, layer in enumerate(self._decoder_layers()):
            hidden = self._layer(layer, i, hidden, step)
            yield
        for r in rows:
            r.length += embeds.shape[1]
        return self.backbone.norm(hidden)

    def _place(self, rows: list[KVSlot], n_new: int) -> tuple[Tensor, Tensor, int]:
        # -> the rows' slot index [B], the new positions [B, T], the key span every row may need
        if any(r.released or r.pool is not self for r in rows):
            raise ValueError("a released or foreign KV slot")
        lengths = [r.length for r in rows]
        span = max(lengths) + n_new  # keys every row may need: [0, span)
        self._ensure_capacity(span)
        starts = to_device(torch.tensor(lengths), self.device)  # pinned: no wait for the step in flight
        positions = starts[:, None] + torch.arange(n_new, device=self.device)[None, :]  # [B, T]
        return to_device(torch.tensor([r.index for r in rows]), self.device), positions, span

    def forward_ragged(self, rows: list[KVSlot], embeds: list[Tensor]) -> Tensor:
        """Rows feeding different numbers of positions (prompts) in one forward: each [1, T_b, H] is
        right-padded to the longest; every row's length grows by its own T_b. The pad positions' K/V lie
        past the row's length, where attention is causal: never seen, overwritten by the next step.
        Returns each row's last real hidden state [B, H]."""
        longest = max(e.shape[1] for e in embeds)
        padded = torch.cat([F.pad(e, (0, 0, 0, longest - e.shape[1])) for e in embeds], dim=0)
        hidden = self.forward(rows, padded)
        last = []
        for b, (row, e) in enumerate(zip(rows, embeds, strict=True)):
            row.length -= longest - e.shape[1]
            last.append(hidden[b, e.shape[1] - 1])
        return torch.stack(last)

    def run(self, index: Tensor, positions: Tensor, embeds: Tensor, span: int) -> Tensor:
        """The layers on device tensors only (no host sync, so a CUDA graph can capture it): rows
        `index` [B] write their keys/values at `positions` [B, T] and attend to keys [0, span) up to their
        own position. `span` = the capacity gives every call the same shapes. Hidden states [B, T, H]."""
        hidden, step = self._inputs(index, positions, embeds, span)
        for i, layer in enumerate(self._decoder_layers()):
            hidden = self._layer(layer, i, hidden, step)
        return self.backbone.norm(hidden)

    def _inputs(
        self, index: Tensor, positions: Tensor, embeds: Tensor, span: int
    ) -> tuple[Tensor, StepInputs]:
        keys = torch.arange(span, device=self.device)
        visible = keys[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, span]
        hidden = embeds.to(self.dtype)
        cos, sin = self.backbone.rotary_emb(hidden, positions)
        mask = attention_mask(visible, self.heads // self.kv_heads, self.dtype)
        return hidden, StepInputs(index, positions, span, mask, cos, sin)

    def _decoder_layers(self) -> Sequence[Qwen2DecoderLayer]:
        # nn.ModuleList is not generic (its items type as Module): these are Qwen2 decoder layers
        return cast(Sequence[Qwen2DecoderLayer], self.backbone.layers[: self.layers])

    def _layer(self, layer: Qwen2DecoderLayer, i: int, hidden: Tensor, step: StepInputs) -> Tensor:
        if self.fused is not None:
            return self._fused_layer(self.fused[i], layer, i, hidden, step)
        residual = hidden
        x = layer.input_layernorm(hidden)
        hidden = residual + self._attention(layer.self_attn, x, i, step)
        residual = hidden
        return residual + layer.mlp(layer.post_attention_layernorm(hidden))

    def _fused_layer(
        self, fused: FusedLayer, layer: Qwen2DecoderLayer, i: int, hidden: Tensor, step: StepInputs
    ) -> Tensor:
        """`_layer` with q/k/v as one matmul, gate/up as one, each RMSNorm one op and q and k rotated
        together: the same function in about half the kernels (a decode step is launch-bound)."""
        batch, n_new, _ = hidden.shape
        heads, kv_heads = self.heads, self.kv_heads
        x = F.rms_norm(hidden, (hidden.shape[-1],), fused.input_norm, fused.eps)
        qkv = F.linear(x, fused.qkv_weight, fused.qkv_bias).view(batch, n_new, heads + 2 * kv_heads, -1)
        qk = rotate(qkv[:, :, : heads + kv_heads], step.cos, step.sin)  # [B, T, heads + kv_heads, D]
        keys, values = self._cache(i, qk[:, :, heads:], qkv[:, :, heads + kv_heads :], step)
        out = grouped_attention(
            qk[:, :, :heads].transpose(1, 2), keys, values, step.mask, layer.self_attn.scaling
        )
        hidden = hidden + layer.self_attn.o_proj(out.transpose(1, 2).reshape(batch, n_new, -1))
        x = F.rms_norm(hidden, (hidden.shape[-1],), fused.post_norm, fused.eps)
        gate, up = F.linear(x, fused.gate_up_weight).chunk(2, dim=-1)
        return hidden + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)

    def _attention(self, attn: Qwen2Attention, x: Tensor, layer: int, step: StepInputs) -> Tensor:
        # x: [B, T, H] -> [B, T, H]
        batch, n_new, _ = x.shape
        q = attn.q_proj(x).view(batch, n_new, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(batch, n_new, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(batch, n_new, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, step.cos, step.sin)
        keys, values = self._cache(layer, k.transpose(1, 2), v.transpose(1, 2), step)
        out = grouped_attention(q, keys, values, step.mask, attn.scaling)
        return attn.o_proj(out.transpose(1, 2).reshape(batch, n_new, -1))

    def _cache(self, layer: int, k: Tensor, v: Tensor, step: StepInputs) -> tuple[Tensor, Tensor]:
        """Write the new keys/values [B, T, kv_heads, D] at the rows' positions; every row's keys and
        values [0, span) -> ([B, kv_heads, span, D], [B, kv_heads, span, D])."""
        rows = step.index[:, None].expand(k.shape[0], k.shape[1])
        # advanced indexing on (slot, position) puts those dims first: [B, T, kv_heads, D]
        self.keys[layer][rows, :, step.positions] = k
        self.values[layer][rows, :, step.positions] = v
        return self.keys[layer][step.index, :, : step.span], self.values[layer][step.index, :, : step.span]


@dataclass(frozen=True)
class StepInputs:
    """What every layer of one forward shares: the rows' slots [B], their new positions [B, T], the key
    span, the causal mask in `grouped_attention`'s layout (`attention_mask`) and the rotary angles
    [B, T, D]."""

    index: Tensor
    positions: Tensor
    span: int
    mask: Tensor
    cos: Tensor
    sin: Tensor


@dataclass(eq=False)
class FusedLayer:
    """One decoder layer's weights as `SlotKV._fused_layer` uses them: q/k/v stacked (one matmul),
    gate/up stacked (one matmul), the norms' weights (copies of the projections; the norms shared)."""

    qkv_weight: Tensor  # [(heads + 2 kv_heads) * D, H]
    qkv_bias: Tensor | None
    gate_up_weight: Tensor  # [2 I, H]
    input_norm: Tensor  # [H]
    post_norm: Tensor  # [H]
    eps: float

    @classmethod
    @torch.no_grad()
    def of(cls, layer: Qwen2DecoderLayer) -> FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        biases: list[Tensor] = [p.bias for p in projections if p.bias is not None]
        return cls(
            qkv_weight=torch.cat([p.weight for p in projections]),
            qkv_bias=torch.cat(biases) if len(biases) == len(projections) else None,
            gate_up_weight=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
            input_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight,
            eps=float(layer.input_layernorm.variance_epsilon),
        )


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of `x` [B, T, heads, D] at angles `cos`/`sin` [B, T, D] (transformers'
    `apply_rotary_pos_emb` with the heads after the positions)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention_mask(visible: Tensor, groups: int, dtype: torch.dtype) -> Tensor:
    """The bool mask `visible` [B, 1, T, S] (True = attend) as `grouped_attention` takes it, made once
    per forward instead of in every layer: additive (0 / -inf in `dtype`: SDPA turns a bool mask into
    this itself, two kernels a layer) and repeated for the `groups` query heads of a kv head
    ([B, 1, groups * T, S])."""
    batch, _, n_new, span = visible.shape
    additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    additive.masked_fill_(~visible, -math.inf)
    return additive[:, :, None].expand(batch, 1, groups, n_new, span).reshape(batch, 1, groups * n_new, span)


def grouped_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Grouped-query attention without copying the keys/values per query head: q [B, heads, T, D] over
    keys/values [B, kv_heads, S, D] (query head h reads kv head h // groups, `repeat_interleave`'s
    layout), `mask` [B, 1, T, S] (bool, or additive in q's dtype), or already in the grouped layout
    [B, 1, groups * T, S] (`attention_mask`) -> [B, heads, T, D]. The `groups` query heads of a kv head
    become `groups * T` query rows of one attention, so the keys are read once instead of written
    `groups` times over (at 16 decode rows x 2048 cached positions that copy was GBs a step)."""
    batch, heads, n_new, dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    if groups == 1:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    q = q.reshape(batch, kv_heads, groups * n_new, dim)
    span = mask.shape[-1]
    if mask.shape[2] != groups * n_new:
        mask = mask[:, :, None].expand(batch, 1, groups, n_new, span).reshape(batch, 1, groups * n_new, span)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, n_new, dim)
