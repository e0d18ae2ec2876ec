"""KVCache: in-place appends equal concatenation, growth moves O(chunk) per append, sharing never aliases."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from voicertc.backends.cosyvoice.flow.kv import MOVE_RATE, KVCache, two_segment_attention, two_segment_sdpa


def _frames(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    # [B=2, H=3, n, Dh=4], non-contiguous like the heads split of a projection
    k = torch.randn(2, n, 3, 4, generator=gen).transpose(1, 2)
    v = torch.randn(2, n, 3, 4, generator=gen).transpose(1, 2)
    return k, v


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=90), min_size=1, max_size=25), st.integers(0, 2**31))
def test_appends_equal_concatenation(sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    cache, ref_k, ref_v = KVCache(), [], []
    for n in sizes:
        k, v = _frames(gen, n)
        ref_k.append(k)
        ref_v.append(v)
        keys, values = cache.append(k, v)
        assert torch.equal(keys, torch.cat(ref_k, dim=2)) and torch.equal(values, torch.cat(ref_v, dim=2))
        assert cache.frames == keys.shape[2] <= cache.capacity


def test_equal_chunks_write_o_chunk_elements():
    """After the first append, each append stores at most (2 + MOVE_RATE) x its own elements, however
    long the history: no append copies what was cached before (the old torch.cat copied it all)."""
    gen = torch.Generator().manual_seed(0)
    cache = KVCache()
    cache.append(*_frames(gen, 100))
    per_append = []
    for _ in range(200):
        before = cache.written_elements
        k, v = _frames(gen, 50)
        cache.append(k, v)
        per_append.append(cache.written_elements - before)
        assert per_append[-1] <= (2 + MOVE_RATE) * (k.numel() + v.numel())
    assert cache.frames == 100 + 200 * 50 and cache.capacity < 4 * cache.frames
    assert sum(per_append) <= 4 * 200 * (2 * 2 * 3 * 4 * 50)  # amortised: < 4x the new elements


def test_shared_copy_is_independent_of_owner_and_other_shares():
    gen = torch.Generator().manual_seed(1)
    owner = KVCache()
    owner.append(*_frames(gen, 40))
    snapshot = owner.keys[:, :, :40].clone()  # type: ignore[index]
    snapshot_ptr = owner.keys.data_ptr()  # type: ignore[union-attr]
    first, second = owner.share(), owner.share()
    assert first.keys is owner.keys  # shared, not copied
    tail_owner, tail_first, tail_second = _frames(gen, 10), _frames(gen, 10), _frames(gen, 10)
    keys_owner, _ = owner.append(*tail_owner)  # the owner keeps writing in place, after frame 40
    assert owner.next_keys is None and keys_owner.data_ptr() == snapshot_ptr
    keys_first, _ = first.append(*tail_first)  # the sharers copy before writing
    keys_second, _ = second.append(*tail_second)
    for keys, tail in [(keys_owner, tail_owner), (keys_first, tail_first), (keys_second, tail_second)]:
        assert torch.equal(keys[:, :, :40], snapshot) and torch.equal(keys[:, :, 40:], tail[0])
    assert first.keys is not owner.keys and second.keys is not first.keys


def test_share_while_growing_keeps_its_frames():
    """A share taken while the owner is moving into a larger buffer sees exactly its frames."""
    gen = torch.Generator().manual_seed(2)
    owner, appended = KVCache(), []
    while owner.next_keys is None:
        appended.append(_frames(gen, 10)[0])
        owner.append(appended[-1], appended[-1])
    share = owner.share()
    expected = torch.cat(appended, dim=2)
    for _ in range(20):  # the owner finishes moving and switches buffers
        k = _frames(gen, 10)[0]
        owner.append(k, k)
    assert owner.next_keys is None
    new = _frames(gen, 5)[0]
    keys, _ = share.append(new, new)
    assert torch.equal(keys, torch.cat([expected, new], dim=2))


def test_reserved_room_is_filled_in_place():
    gen = torch.Generator().manual_seed(3)
    cache = KVCache(reserve_frames=500)
    cache.append(*_frames(gen, 30))
    buffer = cache.keys
    assert cache.capacity == 500
    for _ in range(11):  # up to 360 frames: below the 3/4 mark, nothing moves
        before = cache.written_elements
        k, v = _frames(gen, 30)
        cache.append(k, v)
        assert cache.keys is buffer and cache.written_elements - before == k.numel() + v.numel()
    assert cache.share().reserve_frames == 500


def test_fork_reads_prefix_without_copying_and_forks_stay_independent():
    """A fork's first append stores only its new frames (the owner's frames are a read-only prefix);
    forks, forks of forks and the owner never see each other's frames."""
    gen = torch.Generator().manual_seed(4)
    owner = KVCache(reserve_frames=300)
    owner.append(*_frames(gen, 150))
    snapshot = owner.keys[:, :, :150].clone()  # type: ignore[index]
    first, second = owner.fork(), owner.fork()
    owner_tail, first_tail, second_tail = _frames(gen, 10), _frames(gen, 10), _frames(gen, 20)
    owner.append(*owner_tail)  # the owner writes after frame 150, in the buffer the forks read
    for fork, tail in [(first, first_tail), (second, second_tail)]:
        before = fork.written_elements
        keys, values = fork.append(*tail)
        assert fork.written_elements - before == tail[0].numel() + tail[1].numel()  # no prefix copy
        prefix = fork.prefix()
        assert prefix is not None and torch.equal(prefix[0], snapshot)
        assert torch.equal(keys, tail[0]) and torch.equal(values, tail[1])
        assert fork.frames == 150 + tail[0].shape[2]
    refork = first.fork()  # keeps the prefix, shares its own frames copy-on-write
    refork_tail = _frames(gen, 5)
    keys, _ = refork.append(*refork_tail)
    assert torch.equal(keys, torch.cat([first_tail[0], refork_tail[0]], dim=2))
    keys_first, _ = first.append(*_frames(gen, 5))
    assert torch.equal(keys_first[:, :, :10], first_tail[0])
    assert torch.equal(owner.keys[:, :, :150], snapshot)  # type: ignore[index]
    assert torch.equal(owner.keys[:, :, 150:160], owner_tail[0])  # type: ignore[index]


def test_two_segment_attention_equals_attention_over_concatenation():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 7, 4, generator=gen)
    k, v = torch.randn(2, 3, 19, 4, generator=gen), torch.randn(2, 3, 19, 4, generator=gen)
    mask = torch.rand(7, 19, generator=gen) > 0.3
    mask[:, 0] = True
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = q @ k.transpose(-2, -1) / 2.0
    got = two_segment_attention(scores[..., :12], scores[..., 12:], mask, v[:, :, :12], v[:, :, 12:])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_two_segment_sdpa_equals_sdpa_over_concatenation():
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 7, 3, 4, generator=gen).transpose(1, 2)  # non-contiguous like a heads split
    k, v = torch.randn(2, 3, 19, 4, generator=gen), torch.randn(2, 3, 19, 4, generator=gen)
    mask = torch.rand(7, 19, generator=gen) > 0.3
    mask[:, 12] = True  # every query sees at least one key of each segment
    mask[:, 0] = True
    for visible in [mask, None]:
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        prefix = (k[:, :, :12], v[:, :, :12])
        got = two_segment_sdpa(q, prefix, k[:, :, 12:], v[:, :, 12:], visible)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
