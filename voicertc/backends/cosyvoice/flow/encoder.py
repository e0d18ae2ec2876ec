"""The flow's token encoder (`UpsampleConformerEncoder`), chunk-incremental.

Pipeline (25 Hz tokens in, 50 Hz frames out): Linear+LayerNorm embed (x sqrt(d)) -> pre-lookahead convs
(each token sees the next 3) -> conformer layers (espnet rel-pos attention, chunk mask of 25 tokens) ->
nearest x2 upsample + causal conv -> second embed -> 4 conformer layers (chunk mask of 50 frames) -> LN.

Every stage is causal or chunk-causal, so a chunk that ends on the chunk grid (counted from the prompt
start) can be computed from its own tokens plus `EncoderCache` (left conv context and attention K/V);
a whole-utterance call is the same code with an empty cache and one chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voicertc.backends.cosyvoice.flow.config import ENCODER_UPSAMPLE_STRIDE, EncoderConfig
from voicertc.backends.cosyvoice.flow.kv import KVCache, two_segment_attention

_CONFORMER_LN_EPS = 1e-12
_EMBED_LN_EPS = 1e-5


def chunk_attention_mask(
    query_start: int, query_len: int, chunk: int | None, device: torch.device
) -> Tensor | None:
    """Which keys (absolute 0..query_start+query_len-1) each new query may see; None = all.

    The official static chunk mask: query i sees key j iff j < (i // chunk + 1) * chunk, i.e. every
    earlier chunk plus the whole of its own chunk."""
    key_len = query_start + query_len
    if chunk is None or (query_start // chunk + 1) * chunk >= key_len:
        return None  # every query already sees every key (one chunk, or full attention)
    query_pos = torch.arange(query_start, key_len, device=device)
    limit = (torch.div(query_pos, chunk, rounding_mode="floor") + 1) * chunk
    return torch.arange(key_len, device=device)[None, :] < limit[:, None]


@dataclass
class EncoderCache:
    """Per-utterance encoder state; invariant: `tokens` tokens (a chunk-grid multiple unless final)
    are fully encoded, and the tails hold the left context the causal convs need next."""

    tokens: int = 0
    lookahead_tail: Tensor | None = None  # [1, C, 2] conv1 activations of the last 2 tokens
    upsample_tail: Tensor | None = None  # [1, C, 2] conformer output of the last 2 tokens
    layers: list[KVCache] = field(default_factory=list)
    up_layers: list[KVCache] = field(default_factory=list)


def _rel_position_table(span: int, dim: int) -> Tensor:
    """Espnet rel-pos encodings for relative positions span-1, span-2, ..., -(span-1) (descending).

    Computed as the official table: float32 position x float32 frequency, sin/cos interleaved (the
    official negative half uses (-1 * position) x frequency, which is the same float)."""
    position = torch.arange(span - 1, -span, -1, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * -(math.log(10000.0) / dim))
    angle = position * freq
    table = torch.zeros(position.shape[0], dim)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table


class LinearEmbed(nn.Module):
    """`LinearNoSubsampling` + espnet rel-pos scaling: Linear -> LayerNorm -> x sqrt(d)."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(in_dim, dim), nn.LayerNorm(dim, eps=_EMBED_LN_EPS))
        self.xscale = math.sqrt(dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x) * self.xscale


class RelPositionAttention(nn.Module):
    """Espnet/Transformer-XL attention: scores = (q+u)k^T + (q+v)p_{i-j}^T, over cached + new keys."""

    def __init__(self, heads: int, dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.head_dim))
        self._pos_key: tuple[object, ...] | None = None
        self._pos_span = 0
        self._pos_proj = torch.empty(0)

    def _split(self, x: Tensor) -> Tensor:
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def projected_positions(self, first: int, last: int) -> Tensor:
        """linear_pos of rel positions first, first-1, ..., last as [heads, first-last+1, head_dim].

        Depends only on the weights, so one table is kept and grown (doubling) across calls: a
        chunk then costs a slice, not a projection over everything already spoken."""
        weight = self.linear_pos.weight
        key = (weight.data_ptr(), weight._version, weight.device, weight.dtype)
        need = max(first, -last) + 1
        if self._pos_key != key or self._pos_span < need:
            span = max(need, 2 * self._pos_span, 256)
            table = _rel_position_table(span, weight.shape[1]).to(weight.device, weight.dtype)
            with torch.no_grad():
                proj = self.linear_pos(table).view(-1, self.heads, self.head_dim).transpose(0, 1)
            self._pos_key, self._pos_span, self._pos_proj = key, span, proj.contiguous()
        center = self._pos_span - 1  # row of relative position 0
        return self._pos_proj[:, center - first : center - last + 1]

    def forward(self, x: Tensor, cache: KVCache, mask: Tensor | None) -> Tensor:
        # x: [1, Tq, D] new frames at absolute positions cache.frames.. -> [1, Tq, D]
        start = cache.frames
        q = self._split(self.linear_q(x))
        k, v = cache.append(self._split(self.linear_k(x)), self._split(self.linear_v(x)))
        prefix = cache.prefix()  # a forked cache's read-only prompt frames, never concatenated
        return self._attend(x, q, k, v, prefix, start, mask)

    def forward_rows(self, x: Tensor, caches: list[KVCache], mask: Tensor | None) -> Tensor:
        """`forward` for B rows at the same positions, one cache each (`rows_line_up`): the new
        keys/values go into each row's cache, the attention runs once over the rows' stacked keys."""
        # x: [B, Tq, D] -> [B, Tq, D]
        start = caches[0].frames
        q = self._split(self.linear_q(x))
        k_new, v_new = self._split(self.linear_k(x)), self._split(self.linear_v(x))
        own = [c.append(k_new[b : b + 1], v_new[b : b + 1]) for b, c in enumerate(caches)]
        k, v = torch.cat([o[0] for o in own]), torch.cat([o[1] for o in own])
        return self._attend(x, q, k, v, stacked_prefix(caches), start, mask)

    def _attend(
        self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, prefix: tuple[Tensor, Tensor] | None, start: int,
        mask: Tensor | None,
    ) -> Tensor:  # fmt: skip
        query_len = x.shape[1]
        key_len = k.shape[2] + (0 if prefix is None else prefix[0].shape[2])
        q_u = q + self.pos_bias_u[None, :, None, :]
        scores_own = q_u @ k.transpose(-2, -1)  # [B, H, Tq, U]
        scores_pos = self._position_scores(q, start, query_len, key_len)  # [B, H, Tq, key_len]
        if prefix is None:
            scores = (scores_own + scores_pos) / math.sqrt(self.head_dim)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            attn = torch.softmax(scores, dim=-1)
            out = attn @ v
        else:
            prefix_len = prefix[0].shape[2]
            scores_prefix = q_u @ prefix[0].transpose(-2, -1)  # [B, H, Tq, P]
            scores_prefix = (scores_prefix + scores_pos[..., :prefix_len]) / math.sqrt(self.head_dim)
            scores_own = (scores_own + scores_pos[..., prefix_len:]) / math.sqrt(self.head_dim)
            out = two_segment_attention(scores_prefix, scores_own, mask, prefix[1], v)
        return self.linear_out(out.transpose(1, 2).reshape(x.shape[0], query_len, -1))

    def _position_scores(self, q: Tensor, start: int, query_len: int, key_len: int) -> Tensor:
        """(q + v) p_{i-j} for new queries i = start.. and every key j = 0..key_len-1."""
        # q: [B, H, Tq, Dh] -> [B, H, Tq, key_len]
        q_v = q + self.pos_bias_v[None, :, None, :]
        # relative position r = i - j runs from key_len-1 down to -(query_len-1)
        positions = self.projected_positions(key_len - 1, -(query_len - 1)).to(q.dtype)
        scores_pos_all = q_v @ positions.transpose(-2, -1)  # [B, H, Tq, key_len+query_len-1]
        qi = torch.arange(query_len, device=q.device)[:, None]
        kj = torch.arange(key_len, device=q.device)[None, :]
        index = (key_len - 1) - (start + qi - kj)
        index = index.expand(scores_pos_all.shape[0], self.heads, query_len, key_len)
        return torch.gather(scores_pos_all, 3, index)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-LN conformer layer without macaron or conv module: attention then FFN, both residual."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.self_attn = RelPositionAttention(heads, dim)
        self.feed_forward = FeedForward(dim, hidden)
        self.norm_ff = nn.LayerNorm(dim, eps=_CONFORMER_LN_EPS)
        self.norm_mha = nn.LayerNorm(dim, eps=_CONFORMER_LN_EPS)

    def forward(self, x: Tensor, cache: KVCache, mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.norm_mha(x), cache, mask)
        return x + self.feed_forward(self.norm_ff(x))

    def forward_rows(self, x: Tensor, caches: list[KVCache], mask: Tensor | None) -> Tensor:
        x = x + self.self_attn.forward_rows(self.norm_mha(x), caches, mask)
        return x + self.feed_forward(self.norm_ff(x))


class PreLookaheadLayer(nn.Module):
    """conv1 (k=4, looks 3 tokens ahead) -> leaky ReLU -> causal conv2 (k=3) -> residual.

    `channels`: conv1's output width (CosyVoice3: 80 -> 1024 -> 80); default `dim` (CosyVoice2)."""

    def __init__(self, dim: int, lookahead_tokens: int, channels: int | None = None) -> None:
        super().__init__()
        hidden = dim if channels is None else channels
        self.lookahead_tokens = lookahead_tokens
        self.conv1 = nn.Conv1d(dim, hidden, lookahead_tokens + 1)
        self.conv2 = nn.Conv1d(hidden, dim, 3)

    def forward(self, x: Tensor, context: Tensor | None, cache: EncoderCache) -> Tensor:
        # x: [1, T, D] new tokens, context: [1, lookahead, D] or None (= end of utterance) -> [1, T, D]
        return self.forward_rows(x, context, [cache])

    def forward_rows(self, x: Tensor, context: Tensor | None, caches: list[EncoderCache]) -> Tensor:
        # x: [B, T, D], context: [B, lookahead, D] or None, one cache per row -> [B, T, D]
        h = x.transpose(1, 2)
        if context is None:
            h = F.pad(h, (0, self.lookahead_tokens))
        else:
            h = torch.cat([h, context.transpose(1, 2)], dim=2)
        h = F.leaky_relu(self.conv1(h))
        left = [
            c.lookahead_tail if c.lookahead_tail is not None else h.new_zeros(1, h.shape[1], 2)
            for c in caches
        ]
        h = torch.cat([left[0] if len(left) == 1 else torch.cat(left), h], dim=2)
        for b, c in enumerate(caches):
            c.lookahead_tail = h[b : b + 1, :, -2:]
        return self.conv2(h).transpose(1, 2) + x


class Upsample1D(nn.Module):
    """Nearest x2 then a causal conv (k=5, 4 frames of left context)."""

    def __init__(self, dim: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(dim, dim, 2 * stride + 1)

    def forward(self, x: Tensor, cache: EncoderCache) -> Tensor:
        # x: [1, T, D] tokens -> [1, stride*T, D] frames
        return self.forward_rows(x, [cache])

    def forward_rows(self, x: Tensor, caches: list[EncoderCache]) -> Tensor:
        # x: [B, T, D] tokens, one cache per row -> [B, stride*T, D] frames
        h = x.transpose(1, 2)
        left = [
            c.upsample_tail if c.upsample_tail is not None else h.new_zeros(1, h.shape[1], 2) for c in caches
        ]
        h = torch.cat([left[0] if len(left) == 1 else torch.cat(left), h], dim=2)
        for b, c in enumerate(caches):
            c.upsample_tail = h[b : b + 1, :, -2:]
        h = F.interpolate(h, scale_factor=float(self.stride), mode="nearest")
        return self.conv(h).transpose(1, 2)


class UpsampleConformerEncoder(nn.Module):
    """Token embeddings (25 Hz) -> encoder output (50 Hz), one grid-aligned chunk at a time."""

    def __init__(self, cfg: EncoderConfig, lookahead_tokens: int) -> None:
        super().__init__()
        dim = cfg.output_size
        self.chunk_tokens = cfg.static_chunk_size_tokens
        self.embed = LinearEmbed(cfg.input_size, dim)
        self.after_norm = nn.LayerNorm(dim, eps=_EMBED_LN_EPS)  # registered here: checkpoint order
        self.pre_lookahead_layer = PreLookaheadLayer(dim, lookahead_tokens)
        self.encoders = nn.ModuleList(
            ConformerLayer(dim, cfg.attention_heads, cfg.linear_units) for _ in range(cfg.num_blocks)
        )
        self.up_layer = Upsample1D(dim, ENCODER_UPSAMPLE_STRIDE)
        self.up_embed = LinearEmbed(dim, dim)
        self.up_encoders = nn.ModuleList(
            ConformerLayer(dim, cfg.attention_heads, cfg.linear_units) for _ in range(cfg.up_blocks)
        )

    def new_cache(self, reserve_tokens: int = 0) -> EncoderCache:
        """An empty cache whose K/V buffers start with room for `reserve_tokens` tokens."""
        up_frames = reserve_tokens * self.up_layer.stride
        return EncoderCache(
            layers=[KVCache(reserve_frames=reserve_tokens) for _ in self.encoders],
            up_layers=[KVCache(reserve_frames=up_frames) for _ in self.up_encoders],
        )

    def forward(
        self, token_emb: Tensor, context_emb: Tensor | None, cache: EncoderCache, chunk_masks: bool
    ) -> Tensor:
        # token_emb: [1, T, D_in] new tokens, context_emb: [1, lookahead, D_in] | None -> [1, 2T, D]
        start, length = cache.tokens, token_emb.shape[1]
        x = self.embed(token_emb)
        context = self.embed(context_emb) if context_emb is not None else None
        x = self.pre_lookahead_layer(x, context, cache)
        chunk = self.chunk_tokens if chunk_masks else None
        mask = chunk_attention_mask(start, length, chunk, x.device)
        for layer, kv in zip(self.encoders, cache.layers, strict=True):
            x = layer(x, kv, mask)
        x = self.up_embed(self.up_layer(x, cache))
        stride = self.up_layer.stride
        up_chunk = chunk * stride if chunk is not None else None
        mask = chunk_attention_mask(start * stride, length * stride, up_chunk, x.device)
        for layer, kv in zip(self.up_encoders, cache.up_layers, strict=True):
            x = layer(x, kv, mask)
        cache.tokens = start + length
        return self.after_norm(x)

    def forward_rows(
        self, token_emb: Tensor, context_emb: Tensor | None, caches: list[EncoderCache], chunk_masks: bool
    ) -> Tensor:
        """`forward` for B utterances whose caches line up (`rows_line_up`) as one batch: on a GPU the
        encoder costs its launches, so utterances that start together encode together."""
        # token_emb: [B, T, D_in], context_emb: [B, lookahead, D_in] | None -> [B, 2T, D]
        if not rows_line_up(caches):
            raise ValueError("forward_rows: the caches are at different positions")
        start, length = caches[0].tokens, token_emb.shape[1]
        x = self.embed(token_emb)
        context = self.embed(context_emb) if context_emb is not None else None
        x = self.pre_lookahead_layer.forward_rows(x, context, caches)
        chunk = self.chunk_tokens if chunk_masks else None
        mask = chunk_attention_mask(start, length, chunk, x.device)
        for i, layer in enumerate(_conformers(self.encoders)):
            x = layer.forward_rows(x, [c.layers[i] for c in caches], mask)
        x = self.up_embed(self.up_layer.forward_rows(x, caches))
        stride = self.up_layer.stride
        up_chunk = chunk * stride if chunk is not None else None
        mask = chunk_attention_mask(start * stride, length * stride, up_chunk, x.device)
        for i, layer in enumerate(_conformers(self.up_encoders)):
            x = layer.forward_rows(x, [c.up_layers[i] for c in caches], mask)
        for c in caches:
            c.tokens = start + length
        return self.after_norm(x)


def _conformers(layers: nn.ModuleList) -> list[ConformerLayer]:
    return [cast(ConformerLayer, layer) for layer in layers]  # ModuleList items type as Module


def rows_line_up(caches: list[EncoderCache]) -> bool:
    """Whether the caches can run as rows of one batch: the same tokens encoded and, layer by layer,
    the same read-only prefix and own frames (so one mask and one position table serve every row)."""
    first = caches[0]
    return all(
        c.tokens == first.tokens
        and (c.lookahead_tail is None) == (first.lookahead_tail is None)
        and (c.upsample_tail is None) == (first.upsample_tail is None)
        and len(c.layers) == len(first.layers)
        and len(c.up_layers) == len(first.up_layers)
        and all(
            a.prefix_frames == b.prefix_frames and a.length == b.length
            for a, b in zip(c.layers + c.up_layers, first.layers + first.up_layers, strict=True)
        )
        for c in caches[1:]
    )


def stacked_prefix(caches: list[KVCache]) -> tuple[Tensor, Tensor] | None:
    """The rows' read-only prefixes as one [B, H, P, Dh] pair (a shared voice prefix is expanded, not
    copied); None when the rows have none. Each utterance forks its voice's cache on its own
    (`KVCache.fork`), so the rows' prefixes are different views of the same frames: the same memory,
    shape and strides is the same prefix (a forked prefix is never written)."""
    prefixes = [c.prefix() for c in caches]
    first = prefixes[0]
    if first is None:
        return None
    if all(p is not None and _same_view(p[0], first[0]) and _same_view(p[1], first[1]) for p in prefixes):
        rows = len(caches)
        return first[0].expand(rows, -1, -1, -1), first[1].expand(rows, -1, -1, -1)
    if any(p is None for p in prefixes):
        raise ValueError("stacked_prefix: some rows have a prefix and some do not")
    return torch.cat([p[0] for p in prefixes if p]), torch.cat([p[1] for p in prefixes if p])


def _same_view(a: Tensor, b: Tensor) -> bool:
    return a is b or (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.device == b.device
    )
