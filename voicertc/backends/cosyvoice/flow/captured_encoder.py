"""The flow's token encoder as captured static-shape steps: a replay per (rows, tokens, cached tokens) bucket.

Runs on the engine thread. The eager encoder (`flow.encoder`) is host-bound on a GPU: about 3,200 ATen
calls for one row's chunk (27.8 ms on an H100 for microseconds of arithmetic, more than the whole first
chunk's target). Here a chunk's encoder is one step on static buffers (`accel.captured.StaticSteps`:
the same mechanism as the estimator's), captured once per padded shape and replayed. Shapes are made
static by padding, exactly:
* rows up to a row bucket (1, 2, 4, ... `max_rows`); pad rows are zeros that compute finite values;
* the chunk's tokens up to a token bucket: the lookahead tokens are placed right after the real ones, so
  the pre-lookahead conv sees what it sees eagerly; every later conv is causal; padded keys are hidden by
  the attention bias, so no real output sees the padding; the conv tails are taken at the real end
  (`tail_index`) and the new keys / values and frames are cut back to the real ones;
* cached tokens up to a key bucket (the upsampled stage caches twice as many frames), hidden by the bias;
* relative positions: each layer's projected table (`RelPositionAttention.projected_positions`, weights
  only) is made once for the largest bucket and stays put (a replay reads it in place); a chunk's
  position scores are a fixed window of it, gathered by an index made once per chunk shape.
A chunk outside every bucket (more rows, a longer history, a longer chunk) or past the memory budget runs
on the eager encoder with its exact shapes, counted in `stats.eager`. Rows that do not line up (different
positions) run one call each, as the eager `forward_rows` would refuse them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voicertc.backends.cosyvoice.accel.captured import (
    Capture,
    GraphBudget,
    StageStats,
    StaticSteps,
    StepInput,
    as_tensors,
    run_eagerly,
)
from voicertc.backends.cosyvoice.accel.staging import to_device
from voicertc.backends.cosyvoice.flow.captured import Buckets, StepShape
from voicertc.backends.cosyvoice.flow.encoder import (
    ConformerLayer,
    EncoderCache,
    RelPositionAttention,
    UpsampleConformerEncoder,
    _rel_position_table,
    chunk_attention_mask,
    rows_line_up,
)
from voicertc.backends.cosyvoice.flow.kv import append_rows, joint_of

logger = logging.getLogger(__name__)

# the step's inputs, in order, and each one's row dimension
STEP_INPUTS = (
    "tokens_in", "keep", "lookahead_tail", "upsample_tail", "tail_index",
    "kv_tokens", "kv_frames", "bias_tokens", "bias_frames", "index_tokens", "index_frames",
)  # fmt: skip
IN_ROW_DIMS = (0, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0)
OUT_ROW_DIMS = (0, 0, 0, 2, 2)  # frames, lookahead tail, upsample tail, new token K/V, new frame K/V
NEW_KV = frozenset({3, 4})  # views of the room in the static K/V inputs, appended to the caches at once
ENCODER_BUCKETS = Buckets(
    max_rows=16, key_quantum=32, max_keys=2048, frame_buckets=(32, 64, 128), smallest_rows=1
)
PACKED_PREFIXES = 8  # voices' packed prompt prefixes kept (per stage); the oldest goes first
MAX_CHUNK_TOKENS = 256  # longer chunks (a whole-utterance window) run eagerly: the tables stop here


def encoder_buckets(max_rows: int) -> Buckets:
    """The token encoder's buckets for `max_rows` utterances a batch (tokens, not frames)."""
    b = ENCODER_BUCKETS
    return Buckets(max_rows, b.key_quantum, b.max_keys, b.frame_buckets, smallest_rows=1)


class EncoderStep(nn.Module):
    """One chunk of `UpsampleConformerEncoder` on padded static inputs (see the module doc).

    Inputs (B rows, Tp padded tokens, L lookahead tokens, Kp padded cached tokens, C channels):
        tokens_in      [B, Tp + L, D_in]  token embeddings: the real ones, the lookahead, then zeros
        keep           [B, Tp + L, 1]     1 where an embedded token counts, 0 for the lookahead of a
                                          final chunk (the eager encoder pads with zeros after `embed`)
        lookahead_tail [B, C, 2], upsample_tail [B, C, 2]   the causal convs' left context (zeros first)
        tail_index     [B, 2]             the real end: positions T, T + 1 of the tail-padded sequences
        kv_tokens      [L1, 2, B, H, Kp + Tp, Dh]      cached keys / values, then room for the chunk's
        kv_frames      [L2, 2, B, H, 2Kp + 2Tp, Dh]    (the upsampled stage: frames)
        bias_*         [B, 1, Tq, keys]   0 visible, -inf hidden (chunk mask, padded keys)
        index_*        [B, 1, Tq, keys]   each (query, key)'s row of the layer's position window
    Outputs: frames [B, 2Tp, D] (after the last norm), the two new tails, and views of the new keys /
    values written into the K/V inputs' room."""

    def __init__(self, encoder: UpsampleConformerEncoder, span_tokens: int, like: Tensor) -> None:
        super().__init__()
        self.encoder = encoder
        self.span_tokens = span_tokens
        stride = encoder.up_layer.stride
        self.tables_tokens = [_table(a, span_tokens, like) for a in _attentions(encoder.encoders)]
        self.tables_frames = [_table(a, stride * span_tokens, like) for a in _attentions(encoder.up_encoders)]

    def forward(
        self, tokens_in: Tensor, keep: Tensor, lookahead_tail: Tensor, upsample_tail: Tensor,
        tail_index: Tensor, kv_tokens: Tensor, kv_frames: Tensor, bias_tokens: Tensor, bias_frames: Tensor,
        index_tokens: Tensor, index_frames: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
        enc = self.encoder
        pre = enc.pre_lookahead_layer
        padded = tokens_in.shape[1] - pre.lookahead_tokens
        s = enc.embed(tokens_in) * keep  # [B, Tp + L, D]
        x = s[:, :padded]
        h = F.leaky_relu(pre.conv1(s.transpose(1, 2)))  # [B, C, Tp]: token i sees i..i+L
        h = torch.cat([lookahead_tail, h], dim=2)
        lookahead_new = _at(h, tail_index)
        x = pre.conv2(h).transpose(1, 2) + x
        cached = kv_tokens.shape[4] - padded
        for i, layer in enumerate(_conformers(enc.encoders)):
            x = _layer(layer, x, kv_tokens[i], cached, bias_tokens, index_tokens, self.tables_tokens[i])
        h = torch.cat([upsample_tail, x.transpose(1, 2)], dim=2)
        upsample_new = _at(h, tail_index)
        h = F.interpolate(h, scale_factor=float(enc.up_layer.stride), mode="nearest")
        x = enc.up_embed(enc.up_layer.conv(h).transpose(1, 2))
        frames = x.shape[1]
        cached_frames = kv_frames.shape[4] - frames
        for i, layer in enumerate(_conformers(enc.up_encoders)):
            x = _layer(
                layer, x, kv_frames[i], cached_frames, bias_frames, index_frames, self.tables_frames[i]
            )
        new_tokens = kv_tokens.narrow(4, cached, padded)
        new_frames = kv_frames.narrow(4, cached_frames, frames)
        return enc.after_norm(x), lookahead_new, upsample_new, new_tokens, new_frames


def _layer(
    layer: ConformerLayer, x: Tensor, kv: Tensor, cached: int, bias: Tensor, index: Tensor, table: Tensor
) -> Tensor:
    """One conformer layer: the chunk's keys / values written into `kv`'s room, attention over all of it."""
    a = layer.self_attn
    y = layer.norm_mha(x)
    rows, queries = y.shape[0], y.shape[1]
    q = a._split(a.linear_q(y))
    kv[0].narrow(2, cached, queries).copy_(a._split(a.linear_k(y)))
    kv[1].narrow(2, cached, queries).copy_(a._split(a.linear_v(y)))
    keys, values = kv[0], kv[1]
    scores_own = (q + a.pos_bias_u[None, :, None, :]) @ keys.transpose(-2, -1)  # [B, H, Tq, keys]
    # relative positions keys-1 .. -(Tq-1): a fixed window of the table for this bucket
    center, span = (table.shape[1] - 1) // 2, keys.shape[2]
    window = table[:, center - (span - 1) : center + queries]
    scores_all = (q + a.pos_bias_v[None, :, None, :]) @ window.transpose(-2, -1)
    scores_pos = torch.gather(scores_all, 3, index.expand(rows, a.heads, queries, span))
    scores = (scores_own + scores_pos) / math.sqrt(a.head_dim) + bias
    out = torch.softmax(scores, dim=-1) @ values
    x = x + a.linear_out(out.transpose(1, 2).reshape(rows, queries, -1))
    return x + layer.feed_forward(layer.norm_ff(x))


def _at(h: Tensor, tail_index: Tensor) -> Tensor:
    # h: [B, C, N], tail_index [B, 2] -> [B, C, 2]
    return torch.gather(h, 2, tail_index[:, None, :].expand(h.shape[0], h.shape[1], 2))


def _table(attention: RelPositionAttention, span: int, like: Tensor) -> Tensor:
    """linear_pos of relative positions span-1 .. -(span-1) as [H, 2 span - 1, Dh] (weights only)."""
    weight = attention.linear_pos.weight
    with torch.no_grad():
        table = _rel_position_table(span, weight.shape[1]).to(weight.device, weight.dtype)
        proj = attention.linear_pos(table).view(-1, attention.heads, attention.head_dim).transpose(0, 1)
    return proj.contiguous().to(like.device)


def _conformers(layers: nn.ModuleList) -> list[ConformerLayer]:
    return [layer for layer in layers if isinstance(layer, ConformerLayer)]


def _attentions(layers: nn.ModuleList) -> list[RelPositionAttention]:
    return [layer.self_attn for layer in _conformers(layers)]


@dataclass
class _Positions:
    """The position-only inputs of one chunk shape (made once, reused while the shape repeats)."""

    keep: Tensor
    tail_index: Tensor
    bias_tokens: Tensor
    bias_frames: Tensor
    index_tokens: Tensor
    index_frames: Tensor


def positions(
    start: int, tokens: int, shape: StepShape, stride: int, chunk: int | None, final: bool, lookahead: int,
    dtype: torch.dtype, device: torch.device,
) -> _Positions:  # fmt: skip
    """The bias and gather indices of a chunk of `tokens` real tokens after `start` cached ones, padded
    to `shape` (frames = padded tokens, keys = padded cached tokens). Pure (one row; expanded later)."""
    keep = torch.ones(1, shape.frames + lookahead, 1, dtype=dtype)
    if final:
        keep[:, tokens : tokens + lookahead] = 0.0
    tail = torch.tensor([[tokens, tokens + 1]])
    bias_t, index_t = _bias_and_index(start, tokens, shape.keys, shape.frames, chunk, dtype)
    up_chunk = None if chunk is None else chunk * stride
    bias_f, index_f = _bias_and_index(
        stride * start, stride * tokens, stride * shape.keys, stride * shape.frames, up_chunk, dtype
    )
    return _Positions(*(to_device(t, device) for t in (keep, tail, bias_t, bias_f, index_t, index_f)))


def _bias_and_index(
    start: int, real: int, keys: int, padded: int, chunk: int | None, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """[1, 1, padded, keys + padded] bias (0 / -inf) and position-window index of one stage. Slots:
    cached keys 0..start-1, hidden padding start..keys-1, the chunk's keys keys..keys+padded-1."""
    bias = torch.full((padded, keys + padded), float("-inf"), dtype=dtype)
    visible = chunk_attention_mask(start, real, chunk, torch.device("cpu"))
    if visible is None:
        visible = torch.ones(real, start + real, dtype=torch.bool)
    real_bias = torch.zeros(real, start + real, dtype=dtype).masked_fill(~visible, float("-inf"))
    bias[:real, :start] = real_bias[:, :start]
    bias[:real, keys : keys + real] = real_bias[:, start:]
    bias[real:] = 0.0  # padded queries see everything: finite, dropped
    query = torch.arange(padded)[:, None]
    slot = torch.arange(keys + padded)[None, :]
    # relative position (query i at start+i) - (key position): cached slots are positions, the
    # chunk's slots start at `start`; hidden slots take position 0 of the chunk (any valid row)
    key_pos = torch.where(slot < start, slot, torch.where(slot >= keys, start + slot - keys, start))
    relative = (start + query) - key_pos
    index = (keys + padded - 1) - relative
    return bias[None, None], index[None, None]


class _CacheKV:
    """A stage's cached keys / values of every row, written straight into a static buffer (a
    `FillsBuffer`): the voice prefix once for all rows, each row's own frames after it."""

    def __init__(self, layers: list[list], keys: int, room: int, like: Tensor, prefix_packs: dict) -> None:
        self.layers = layers  # [row][layer] -> KVCache
        self.keys, self.room = keys, room
        first = layers[0][0]
        self.frames = first.frames
        head_dim = like.shape[-1]
        heads = like.shape[1]
        self._shape = torch.Size([len(layers[0]), 2, len(layers), heads, keys + room, head_dim])
        self._dtype, self._device = like.dtype, like.device
        self._prefix_packs = prefix_packs

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def element_size(self) -> int:
        return torch.empty(0, dtype=self._dtype).element_size()

    def tensor(self) -> Tensor:
        out = torch.zeros(self._shape, dtype=self._dtype, device=self._device)
        self.fill(out)
        return out

    def fill(self, out: Tensor) -> None:
        rows = self.layers
        prefix = self._prefix(rows)
        p = 0 if prefix is None else prefix.shape[4]
        if prefix is not None:
            out.narrow(4, 0, p).copy_(prefix.expand(-1, -1, len(rows), -1, -1, -1))
        if self.frames == p:
            return
        for i in range(len(rows[0])):
            layer = [row[i] for row in rows]
            own = layer[0].length
            joint = joint_of(layer)
            if joint is not None:  # rows that started together: their own frames in one copy
                out[i, 0].narrow(2, p, own).copy_(joint.keys[:, :, :own])
                out[i, 1].narrow(2, p, own).copy_(joint.values[:, :, :own])
                continue
            for b, cache in enumerate(layer):
                assert cache.keys is not None and cache.values is not None
                out[i, 0, b].narrow(1, p, cache.length).copy_(cache.keys[0, :, : cache.length])
                out[i, 1, b].narrow(1, p, cache.length).copy_(cache.values[0, :, : cache.length])

    def _prefix(self, rows: list[list]) -> Tensor | None:
        """The rows' read-only prefix of every layer as one [L, 2, 1, H, P, Dh] tensor: one voice's prompt
        is packed once (its utterances' forks are views of the same frames, `KVCache.fork`, which are
        never written again), rows on different prefixes get theirs stacked."""
        firsts = [row[0].prefix_keys for row in rows]
        first = firsts[0]
        if first is None:
            return None
        key = (first.data_ptr(), tuple(first.shape), first.device)
        if all(f is not None and (f.data_ptr(), tuple(f.shape), f.device) == key for f in firsts):
            packed = self._prefix_packs.get(key)
            if packed is None:  # the pack holds the prefix (its frames stay put while the pack lives)
                if len(self._prefix_packs) >= PACKED_PREFIXES:
                    self._prefix_packs.pop(next(iter(self._prefix_packs)))
                packed = self._prefix_packs[key] = (first, _pack_prefix(rows[0]))
            return packed[1]
        return torch.cat([_pack_prefix(row) for row in rows], dim=2)


def _pack_prefix(row: list) -> Tensor:
    return torch.stack([torch.stack([c.prefix_keys, c.prefix_values]) for c in row])  # [L, 2, 1, H, P, Dh]


class CapturedEncoder:
    """Drop-in for the eager token encoder in `CausalFlow` (`encoder_runner`): a chunk of lined-up rows
    runs as the replay of its bucket, or eagerly with its exact shapes when it fits no bucket."""

    def __init__(
        self,
        encoder: UpsampleConformerEncoder,
        *,
        buckets: Buckets | None = None,
        capture: Capture = run_eagerly,
        budget: GraphBudget | None = None,
        max_chunk_tokens: int = MAX_CHUNK_TOKENS,
    ) -> None:
        self.encoder = encoder
        self.buckets = buckets or ENCODER_BUCKETS
        self.max_chunk_tokens = max_chunk_tokens
        like = next(encoder.parameters())
        self.module = EncoderStep(
            encoder, self.buckets.max_keys + self.buckets.frames(max_chunk_tokens), like
        )
        self.steps = StaticSteps(
            "flow encoder", self.module, IN_ROW_DIMS, OUT_ROW_DIMS, capture=capture,
            budget=budget or GraphBudget(limit_bytes=2**31),
        )  # fmt: skip
        self._positions_key: tuple[object, ...] | None = None
        self._positions: _Positions | None = None
        self._prefix_packs: dict[tuple[object, ...], tuple[Tensor, Tensor]] = {}

    @property
    def stats(self) -> StageStats:
        return self.steps.stats

    def __call__(
        self, token_emb: Tensor, context_emb: Tensor | None, caches: list[EncoderCache], chunk_masks: bool
    ) -> Tensor:
        """`UpsampleConformerEncoder.forward_rows` (one row: `forward`): [B, T, D_in] -> [B, 2T, D]."""
        if len(caches) > 1 and not rows_line_up(caches):
            return torch.cat(
                [self(token_emb[b : b + 1], None if context_emb is None else context_emb[b : b + 1], [c],
                      chunk_masks) for b, c in enumerate(caches)]
            )  # fmt: skip
        start, tokens = caches[0].tokens, token_emb.shape[1]
        shape = self.buckets.shape(len(caches), tokens, start)
        if shape is None or tokens > self.max_chunk_tokens or not tokens:
            self.steps.stats.eager += 1
            return self._eager(token_emb, context_emb, caches, chunk_masks)
        inputs = self._inputs(token_emb, context_emb, caches, chunk_masks, shape)
        outputs = self.steps.run(shape.rows, inputs, borrowed=NEW_KV)
        if outputs is None:
            outputs = self.module(*as_tensors(inputs))
        frames, lookahead_new, upsample_new, new_tokens, new_frames = outputs
        stride = self.encoder.up_layer.stride
        rows, real = len(caches), stride * tokens
        for i in range(len(caches[0].layers)):  # rows that started together: one store a layer
            layer = new_tokens[i, :, :rows, :, :tokens]
            append_rows([c.layers[i] for c in caches], layer[0], layer[1])
        for i in range(len(caches[0].up_layers)):
            layer = new_frames[i, :, :rows, :, :real]
            append_rows([c.up_layers[i] for c in caches], layer[0], layer[1])
        for b, cache in enumerate(caches):
            cache.lookahead_tail = lookahead_new[b : b + 1]
            cache.upsample_tail = upsample_new[b : b + 1]
            cache.tokens = start + tokens
        return frames[:, : stride * tokens]

    def _eager(
        self, token_emb: Tensor, context_emb: Tensor | None, caches: list[EncoderCache], chunk_masks: bool
    ) -> Tensor:
        if len(caches) == 1:
            return self.encoder(token_emb, context_emb, caches[0], chunk_masks)
        return self.encoder.forward_rows(token_emb, context_emb, caches, chunk_masks)

    def _inputs(
        self, token_emb: Tensor, context_emb: Tensor | None, caches: list[EncoderCache], chunk_masks: bool,
        shape: StepShape,
    ) -> list[StepInput]:  # fmt: skip
        rows, tokens, width = token_emb.shape
        lookahead = self.encoder.pre_lookahead_layer.lookahead_tokens
        stride = self.encoder.up_layer.stride
        start = caches[0].tokens
        ahead = context_emb if context_emb is not None else token_emb.new_zeros(rows, lookahead, width)
        tokens_in = F.pad(torch.cat([token_emb, ahead], dim=1), (0, 0, 0, shape.frames - tokens))
        pos = self._chunk_positions(start, tokens, shape, chunk_masks, context_emb is None, token_emb)
        channels = self.encoder.pre_lookahead_layer.conv2.in_channels
        lookahead_tail = _tails([c.lookahead_tail for c in caches], channels, token_emb)
        upsample_tail = _tails(
            [c.upsample_tail for c in caches], self.encoder.up_layer.conv.in_channels, token_emb
        )
        like_t = like_f = self._kv_like(token_emb)
        kv_tokens = _CacheKV([c.layers for c in caches], shape.keys, shape.frames, like_t, self._prefix_packs)
        kv_frames = _CacheKV(
            [c.up_layers for c in caches], stride * shape.keys, stride * shape.frames, like_f,
            self._prefix_packs,
        )  # fmt: skip
        expand = (rows, -1, -1, -1)
        return [
            tokens_in, pos.keep.expand(rows, -1, -1), lookahead_tail, upsample_tail,
            pos.tail_index.expand(rows, -1), kv_tokens, kv_frames,
            *(p.expand(*expand) for p in (pos.bias_tokens, pos.bias_frames)),
            *(p.expand(*expand) for p in (pos.index_tokens, pos.index_frames)),
        ]  # fmt: skip

    def _kv_like(self, like: Tensor) -> Tensor:
        """A [1, H, 1, Dh] tensor of the attention's K/V shape, dtype and device."""
        attention = _attentions(self.encoder.encoders)[0]
        return like.new_empty(1, attention.heads, 1, attention.head_dim)

    def _chunk_positions(
        self, start: int, tokens: int, shape: StepShape, chunk_masks: bool, final: bool, like: Tensor
    ) -> _Positions:
        key = (start, tokens, shape, chunk_masks, final, like.dtype, like.device)
        if key != self._positions_key or self._positions is None:
            chunk = self.encoder.chunk_tokens if chunk_masks else None
            lookahead = self.encoder.pre_lookahead_layer.lookahead_tokens
            self._positions = positions(
                start, tokens, shape, self.encoder.up_layer.stride, chunk, final, lookahead, like.dtype,
                like.device,
            )  # fmt: skip
            self._positions_key = key
        return self._positions

    @torch.inference_mode()
    def warm(self, rows: list[int], tokens: list[int], keys: list[int], like: Tensor) -> int:
        """Capture the buckets of every (rows, tokens, cached tokens) given (start-up, before the engine
        says ready); returns how many are captured now. `like`: a tensor of the encoder's dtype/device."""
        before = self.steps.stats.captures
        enc = self.encoder
        width = cast(nn.Linear, enc.embed.out[0]).in_features  # D_in: the token embeddings' width
        attention = _attentions(enc.encoders)[0]
        heads, head_dim = attention.heads, attention.head_dim
        stride, lookahead = enc.up_layer.stride, enc.pre_lookahead_layer.lookahead_tokens
        channels = enc.pre_lookahead_layer.conv2.in_channels
        dim = enc.up_layer.conv.in_channels
        for r in sorted(rows, reverse=True):  # the largest first: the smaller buckets' inputs are views
            for t in sorted(tokens, reverse=True):
                for k in sorted(keys, reverse=True):
                    shape = self.buckets.shape(r, t, k)
                    if shape is None or (shape.rows, shape.frames, shape.keys) != (r, t, k):
                        continue
                    pos = positions(
                        0, t, shape, stride, enc.chunk_tokens, False, lookahead, like.dtype, like.device
                    )
                    zeros = like.new_zeros
                    inputs = [
                        zeros(r, t + lookahead, width), pos.keep.expand(r, -1, -1), zeros(r, channels, 2),
                        zeros(r, dim, 2), pos.tail_index.expand(r, -1),
                        zeros(len(enc.encoders), 2, r, heads, k + t, head_dim),
                        zeros(len(enc.up_encoders), 2, r, heads, stride * (k + t), head_dim),
                        *(p.expand(r, -1, -1, -1) for p in (pos.bias_tokens, pos.bias_frames)),
                        *(p.expand(r, -1, -1, -1) for p in (pos.index_tokens, pos.index_frames)),
                    ]  # fmt: skip
                    if self.steps.run(r, inputs) is None and self.steps.stats.failed is not None:
                        return self.steps.stats.captures - before
        return self.steps.stats.captures - before


def _tails(tails: list[Tensor | None], channels: int, like: Tensor) -> Tensor:
    """The rows' conv tails as [B, C, 2] (zeros where a row has none yet)."""
    if all(t is None for t in tails):
        return like.new_zeros(len(tails), channels, 2)
    return torch.cat([t if t is not None else like.new_zeros(1, channels, 2) for t in tails])
