"""`append_rows`: several caches appended as one batch (the captured token encoder's rows) hold exactly
what row-by-row `KVCache.append` gives them, through growth, a row that appends alone, and caches that
start from a forked prefix; rows that start together share one buffer pair and store a chunk at once."""

from __future__ import annotations

import torch

from voicertc.backends.cosyvoice.flow.kv import KVCache, append_rows

ROWS, HEADS, DIM = 3, 2, 4


def _chunks(sizes: list[int], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(ROWS, HEADS, n, DIM, generator=gen), torch.randn(ROWS, HEADS, n, DIM, generator=gen))
        for n in sizes
    ]


def _frames(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    assert cache.keys is not None and cache.values is not None
    return cache.keys[:, :, : cache.length], cache.values[:, :, : cache.length]


def _same(a: list[KVCache], b: list[KVCache]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.length == y.length and x.frames == y.frames
        for got, want in zip(_frames(x), _frames(y), strict=True):
            assert torch.equal(got, want)


def test_rows_appended_together_equal_row_by_row_appends_through_growth():
    sizes = [40, 30, 50, 100, 7]  # past the first buffer (2 x 40) and past its doubling
    joint, alone = [KVCache() for _ in range(ROWS)], [KVCache() for _ in range(ROWS)]
    for keys, values in _chunks(sizes):
        append_rows(joint, keys, values)
        for b, cache in enumerate(alone):
            cache.append(keys[b : b + 1], values[b : b + 1])
        _same(joint, alone)
    first = joint[0].joint
    assert first is not None and all(c.joint is first for c in joint)  # one buffer pair for the rows
    assert all(
        c.keys is not None and c.keys.data_ptr() == first.keys[b].data_ptr() for b, c in enumerate(joint)
    )


def test_a_row_that_appends_alone_leaves_the_joint_buffer_and_stays_exact():
    joint, alone = [KVCache() for _ in range(ROWS)], [KVCache() for _ in range(ROWS)]
    chunks = _chunks([20, 5, 20, 200])
    append_rows(joint, *chunks[0])
    for b, cache in enumerate(alone):
        cache.append(chunks[0][0][b : b + 1], chunks[0][1][b : b + 1])
    joint[1].append(chunks[1][0][1:2], chunks[1][1][1:2])  # one row goes on alone (lengths differ now)
    alone[1].append(chunks[1][0][1:2], chunks[1][1][1:2])
    for keys, values in chunks[2:]:
        append_rows(joint, keys, values)
        for b, cache in enumerate(alone):
            cache.append(keys[b : b + 1], values[b : b + 1])
        _same(joint, alone)


def test_forked_caches_append_together_after_their_prefix():
    voice = KVCache()
    prefix_k, prefix_v = torch.randn(1, HEADS, 9, DIM), torch.randn(1, HEADS, 9, DIM)
    voice.append(prefix_k, prefix_v)
    joint, alone = [voice.fork() for _ in range(ROWS)], [voice.fork() for _ in range(ROWS)]
    for keys, values in _chunks([12, 30], seed=1):
        append_rows(joint, keys, values)
        for b, cache in enumerate(alone):
            cache.append(keys[b : b + 1], values[b : b + 1])
    _same(joint, alone)
    assert all(c.prefix_frames == 9 and c.frames == 9 + 42 for c in joint)
    assert torch.equal(voice.keys[:, :, :9], prefix_k)  # the voice's frames untouched
