"""Growing key/value caches for the flow's chunk-incremental attention (engine thread).

Why: appending a chunk's keys with `torch.cat` copies everything already spoken on every chunk, so a
long utterance's chunks get slower and slower. Here each cache owns a buffer with spare capacity; a
chunk writes its frames in place and attention reads the view `[:, :, :length]`.

Growth is de-amortised so that no single chunk pays for the history either: once a buffer is 3/4 full,
one twice as large is allocated and the old frames move into it `MOVE_RATE` frames per frame appended
(new frames go to both buffers meanwhile); the switch happens when everything has moved, well before
the old buffer is full. A chunk therefore writes and moves O(chunk) elements; only an append larger
than the remaining room (e.g. a first chunk, or a huge hop) copies the history at once.

Sharing (`share()`, what `FlowStreamState.clone()` uses): the clone reads the same buffer and copies
its frames into a buffer of its own before its first write (copy on write). The owner only ever writes
at positions >= its length, and a sharer never reads beyond the length it was given, so neither can
corrupt the other; `share()` itself copies no tensor data.

Forking (`fork()`, what `FlowStreamState.clone()` uses for a voice's prompt state): the fork reads the
owner's frames as a read-only `prefix` and appends into a buffer of its own that starts empty, so even
its first chunk copies nothing of the prompt; attention then runs over the two segments (`prefix()`
and what `append` returns), see `two_segment_attention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

MIGRATE_AT = 0.75  # start moving into a 2x buffer once this fraction of the capacity is filled
MOVE_RATE = 4  # frames moved per frame appended while moving (done after 3/16 of the capacity)
MIN_CAPACITY_FRAMES = 64


@dataclass(eq=False)
class JointRows:
    """The own buffers of several caches as the rows of one tensor pair (`append_rows`)."""

    keys: Tensor  # [B, heads, capacity, head_dim]
    values: Tensor


@dataclass
class KVCache:
    """Keys and values of the frames [0, length), each [B, heads, capacity, head_dim].

    Invariants: `keys[:, :, :length]` holds every cached frame; while growing, `next_keys` holds frames
    [0, moved) and [move_end, length) too. `shared`: the buffer may be read by another cache, so it is
    never written; the first append copies into a private buffer. `written_elements` counts elements
    stored (new frames, moved frames, copies) over the cache's life: what a chunk really costs here."""

    keys: Tensor | None = None
    values: Tensor | None = None
    length: int = 0
    shared: bool = False
    next_keys: Tensor | None = None
    next_values: Tensor | None = None
    moved: int = 0
    move_end: int = 0
    written_elements: int = 0
    reserve_frames: int = 0  # capacity of the first buffer (see `FlowStreamState`: CPU reserves)
    prefix_keys: Tensor | None = None  # [B, heads, P, head_dim] frames [0, P), read-only (`fork`)
    prefix_values: Tensor | None = None
    joint: JointRows | None = None  # own frames as row `joint_row` of a joint buffer (`append_rows`)
    joint_row: int = 0

    @property
    def prefix_frames(self) -> int:
        return 0 if self.prefix_keys is None else self.prefix_keys.shape[2]

    @property
    def frames(self) -> int:
        """Every frame attended to: the read-only prefix plus the own frames [0, length)."""
        return self.prefix_frames + self.length

    def prefix(self) -> tuple[Tensor, Tensor] | None:
        """The read-only leading frames (keys, values), or None when every frame is in the own buffer."""
        if self.prefix_keys is None or self.prefix_values is None:
            return None
        return self.prefix_keys, self.prefix_values

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def share(self) -> KVCache:
        """A cache with the same frames that copies them before its first write (no data copied now)."""
        return KVCache(
            self.keys,
            self.values,
            self.length,
            shared=True,
            written_elements=self.written_elements,
            reserve_frames=self.reserve_frames,
            prefix_keys=self.prefix_keys,
            prefix_values=self.prefix_values,
        )

    def fork(self) -> KVCache:
        """A cache whose frames so far are a read-only prefix (views, never copied, also not on the
        first append) and whose own buffer starts empty; a cache that already has a prefix keeps it
        and shares its own frames copy-on-write (`share`)."""
        if self.prefix_keys is not None or self.keys is None or self.values is None or not self.length:
            return self.share()
        return KVCache(
            written_elements=self.written_elements,
            reserve_frames=self.reserve_frames,
            prefix_keys=self.keys[:, :, : self.length],
            prefix_values=self.values[:, :, : self.length],
        )

    def filled_bytes(self) -> int:
        """Bytes of the own frames (a prefix belongs to the cache it was forked from)."""
        if self.keys is None:
            return 0
        per_frame = self.keys[:, :, :1].numel() * self.keys.element_size()
        return 2 * per_frame * self.length

    def append(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new frames; returns views of every own frame (old ++ new, after any `prefix()`),
        no copy of the old."""
        # keys, values: [B, H, n, Dh] -> ([B, H, length + n, Dh], [B, H, length + n, Dh])
        start, end = self.length, self.length + keys.shape[2]
        if self.keys is None or self.values is None or self.shared or end > self.capacity:
            self._reallocate(end, keys)
        assert self.keys is not None and self.values is not None
        self._store(self.keys, self.values, start, keys, values)
        if self.next_keys is not None and self.next_values is not None:
            self._store(self.next_keys, self.next_values, start, keys, values)
        self.length = end
        self._grow(end - start)
        return self.keys[:, :, :end], self.values[:, :, :end]

    # ----------------------------------------------------------------- internals
    def _store(self, key_buf: Tensor, value_buf: Tensor, start: int, keys: Tensor, values: Tensor) -> None:
        end = start + keys.shape[2]
        key_buf[:, :, start:end] = keys
        value_buf[:, :, start:end] = values
        self.written_elements += keys.numel() + values.numel()

    def _reallocate(self, needed: int, like: Tensor) -> None:
        """A private buffer with room for `needed` frames holding frames [0, length) (one copy)."""
        if self.next_keys is not None and self.next_keys.shape[2] >= needed and not self.shared:
            self._move(self.move_end - self.moved)  # finish the move already under way
            return
        shape = (
            like.shape[0],
            like.shape[1],
            max(MIN_CAPACITY_FRAMES, 2 * needed, self.reserve_frames),
            like.shape[3],
        )
        keys, values = like.new_empty(shape), like.new_empty(shape)
        if self.keys is not None and self.values is not None and self.length:
            self._store(keys, values, 0, self.keys[:, :, : self.length], self.values[:, :, : self.length])
        self.keys, self.values, self.shared = keys, values, False
        self.next_keys = self.next_values = None

    def _grow(self, appended: int) -> None:
        assert self.keys is not None and self.values is not None
        if self.next_keys is None and self.length > MIGRATE_AT * self.capacity:
            shape = (*self.keys.shape[:2], 2 * self.capacity, self.keys.shape[3])
            self.next_keys, self.next_values = self.keys.new_empty(shape), self.values.new_empty(shape)
            self.moved, self.move_end = 0, self.length
        if self.next_keys is not None:
            self._move(MOVE_RATE * appended)

    def _move(self, frames: int) -> None:
        """Move up to `frames` not yet moved frames into the next buffer; switch when all are there."""
        assert self.keys is not None and self.values is not None
        assert self.next_keys is not None and self.next_values is not None
        stop = min(self.move_end, self.moved + frames)
        old_keys, old_values = self.keys[:, :, self.moved : stop], self.values[:, :, self.moved : stop]
        self._store(self.next_keys, self.next_values, self.moved, old_keys, old_values)
        self.moved = stop
        if stop == self.move_end:
            self.keys, self.values = self.next_keys, self.next_values
            self.next_keys = self.next_values = None


def append_rows(caches: list[KVCache], keys: Tensor, values: Tensor) -> None:
    """`append` of row b of `keys` / `values` [B, H, n, Dh] to `caches[b]`, with one store for all rows
    when they can share one: fresh caches (nothing own yet; one row too) get their own buffers as the
    rows of one buffer pair (`JointRows`), and while every row of it appends together at one length, a
    chunk is one copy for keys and one for values, growing by doubling with one copy of every row (what
    a batched chunk of utterances that started together costs on a GPU: launches, not bytes). Any
    other set of caches appends row by row (`KVCache.append`), and a row that appended alone or grew
    on its own leaves the joint buffer for good."""
    n = keys.shape[2]
    joint = joint_of(caches)
    if joint is None and all(_fresh(c) for c in caches):
        joint = _new_joint(caches, keys)
    if joint is None:
        for b, cache in enumerate(caches):
            cache.append(keys[b : b + 1], values[b : b + 1])
        return
    start = caches[0].length
    end = start + n
    if end > joint.keys.shape[2]:
        joint = _grow_joint(caches, joint, end)
    joint.keys[:, :, start:end] = keys
    joint.values[:, :, start:end] = values
    for cache in caches:
        cache.length = end
        cache.written_elements += 2 * keys[:1].numel()


def _fresh(cache: KVCache) -> bool:
    return cache.keys is None and not cache.length and cache.next_keys is None


def joint_of(caches: list[KVCache]) -> JointRows | None:
    """The joint buffer every cache is still a row of, in order and at one length (else None)."""
    joint = caches[0].joint
    if joint is None or joint.keys.shape[0] != len(caches):
        return None
    for b, cache in enumerate(caches):
        if (
            cache.joint is not joint
            or cache.joint_row != b
            or cache.shared
            or cache.next_keys is not None
            or cache.length != caches[0].length
            or cache.keys is None
            or cache.keys.data_ptr() != joint.keys[b].data_ptr()
            or cache.keys.shape[2] != joint.keys.shape[2]
        ):
            return None
    return joint


def _new_joint(caches: list[KVCache], like: Tensor) -> JointRows:
    capacity = max(MIN_CAPACITY_FRAMES, 2 * like.shape[2], caches[0].reserve_frames)
    shape = (len(caches), like.shape[1], capacity, like.shape[3])
    return _adopt(caches, JointRows(like.new_empty(shape), like.new_empty(shape)))


def _grow_joint(caches: list[KVCache], joint: JointRows, needed: int) -> JointRows:
    length = caches[0].length
    shape = (*joint.keys.shape[:2], max(2 * joint.keys.shape[2], 2 * needed), joint.keys.shape[3])
    grown = JointRows(joint.keys.new_empty(shape), joint.values.new_empty(shape))
    grown.keys[:, :, :length] = joint.keys[:, :, :length]
    grown.values[:, :, :length] = joint.values[:, :, :length]
    for cache in caches:
        cache.written_elements += 2 * joint.keys[:1, :, :length].numel()
    return _adopt(caches, grown)


def _adopt(caches: list[KVCache], joint: JointRows) -> JointRows:
    for b, cache in enumerate(caches):
        cache.keys, cache.values = joint.keys[b : b + 1], joint.values[b : b + 1]
        cache.joint, cache.joint_row, cache.shared = joint, b, False
    return joint


def two_segment_attention(
    scores_prefix: Tensor, scores_own: Tensor, mask: Tensor | None, prefix_values: Tensor, values: Tensor
) -> Tensor:
    """Exact softmax attention over [prefix ++ own] keys without concatenating keys, values or scores.

    The softmax is written out (shared running max, exp, one normaliser) so every tensor stays
    contiguous; `mask` ([Tq, P + U] bool, True = visible) covers both segments as it would the
    concatenated keys."""
    # scores_prefix: [B, H, Tq, P], scores_own: [B, H, Tq, U] (already scaled) -> [B, H, Tq, Dh]
    prefix_len = scores_prefix.shape[-1]
    if mask is not None:
        scores_prefix = scores_prefix.masked_fill(~mask[:, :prefix_len], float("-inf"))
        scores_own = scores_own.masked_fill(~mask[:, prefix_len:], float("-inf"))
    peak = torch.maximum(scores_prefix.amax(dim=-1, keepdim=True), scores_own.amax(dim=-1, keepdim=True))
    weights_prefix = (scores_prefix - peak).exp_()
    weights_own = (scores_own - peak).exp_()
    total = weights_prefix.sum(dim=-1, keepdim=True) + weights_own.sum(dim=-1, keepdim=True)
    return (weights_prefix @ prefix_values + weights_own @ values) / total


def two_segment_sdpa(
    q: Tensor, prefix: tuple[Tensor, Tensor], keys: Tensor, values: Tensor, mask: Tensor | None
) -> Tensor:
    """Scaled dot-product attention of `q` over [prefix ++ own] keys, exactly, without concatenating.

    On CPU each segment runs the fused flash kernel, which also returns its log-sum-exp, and the two
    partial outputs are merged by their softmax mass; elsewhere the scores are formed explicitly."""
    # q: [B, H, Tq, Dh], prefix: ([B, H, P, Dh], [B, H, P, Dh]), keys/values: [B, H, U, Dh] -> [B, H, Tq, Dh]
    prefix_keys, prefix_values = prefix
    prefix_len = prefix_keys.shape[2]
    if q.device.type != "cpu" or not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        scaled = (q * (1.0 / math.sqrt(q.shape[-1]))).contiguous()
        scores_prefix = scaled @ prefix_keys.transpose(-2, -1)
        scores_own = scaled @ keys.transpose(-2, -1)
        return two_segment_attention(scores_prefix, scores_own, mask, prefix_values, values)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    parts = []
    for segment_keys, segment_values, visible in [
        (prefix_keys, prefix_values, None if mask is None else mask[:, :prefix_len]),
        (keys, values, None if mask is None else mask[:, prefix_len:]),
    ]:
        bias = None if visible is None else q.new_zeros(visible.shape).masked_fill(~visible, float("-inf"))
        parts.append(flash(q, segment_keys, segment_values, 0.0, False, attn_mask=bias))
    (out_prefix, lse_prefix), (out_own, lse_own) = parts
    lse = torch.logaddexp(lse_prefix, lse_own)  # [B, H, Tq]
    share_prefix = (lse_prefix - lse).exp().unsqueeze(-1).to(q.dtype)
    share_own = (lse_own - lse).exp().unsqueeze(-1).to(q.dtype)
    return out_prefix * share_prefix + out_own * share_own
