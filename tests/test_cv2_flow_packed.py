"""A flow context packed for graph runners (`PackedCache`): append-only sharing (a saved state costs no
copy, two owners of one prompt never write into each other's frames and read the prompt where it is,
never copied), bounded spare room, and the round trip back to the per-slot form the eager estimator
reads (a prefix included)."""

from __future__ import annotations

import torch

from voicertc.backends.cosyvoice.flow.unet import GROW_FRAMES, EstimatorCache, PackedCache

SLOTS = ((0, 3), (3, 2))  # two convs: 3 and 2 channels


def _packed(frames: int, capacity: int = 64) -> PackedCache:
    kv = torch.zeros(2, 2, 2, 1, capacity, 4)
    kv[:, :, :, :, :frames] = torch.arange(frames, dtype=torch.float32)[:, None]
    return PackedCache(torch.zeros(2, 5, 2), kv, frames, SLOTS)


def _frames(n: int, first: float) -> torch.Tensor:
    return (first + torch.arange(n, dtype=torch.float32))[:, None].expand(2, 2, 2, 1, n, 4).clone()


def test_a_saved_share_costs_no_copy_and_restores_its_own_frames():
    live = _packed(10)
    live.store(live.conv, _frames(2, 10.0))  # the live state writes: it is the writer now
    before = live.kv.data_ptr()
    saved = live.share()  # the batch's retry copy
    live.store(live.conv, _frames(3, 12.0))
    assert live.kv.data_ptr() == before and live.frames == 15  # appended in place
    saved.store(saved.conv, _frames(3, 100.0))  # a retry from the saved state: its own tensor
    assert saved.kv.data_ptr() != before
    assert saved.prefix is not None and saved.prefix.data_ptr() == before  # its 12 frames: read in place
    assert torch.equal(saved.context(13)[0, 0, 0, 0, :, 0], torch.tensor([*range(12), 100.0]))
    assert torch.equal(live.context(15)[0, 0, 0, 0, :, 0], torch.arange(15, dtype=torch.float32))
    assert saved.nbytes() < live.nbytes()  # the saved view owns only its 1 new frame (+ conv)


def test_two_owners_of_one_prompt_never_write_into_each_others_frames():
    prompt = _packed(8)
    a, b, c = prompt.share(), prompt.share(), prompt.share()
    a.store(a.conv, _frames(4, 50.0))
    b.store(b.conv, _frames(4, 70.0))
    c.store(c.conv, _frames(2, 90.0))
    assert torch.equal(a.context(12)[1, 1, 1, 0, :, 3], torch.tensor([*range(8), 50.0, 51.0, 52.0, 53.0]))
    assert torch.equal(b.context(12)[1, 1, 1, 0, :, 3], torch.tensor([*range(8), 70.0, 71.0, 72.0, 73.0]))
    assert torch.equal(c.context(10)[0, 1, 0, 0, :, 1], torch.tensor([*range(8), 90.0, 91.0]))
    assert a.kv.data_ptr() != b.kv.data_ptr() and prompt.frames == 8
    assert torch.equal(prompt.context(8)[0, 0, 0, 0, :, 0], torch.arange(8, dtype=torch.float32))
    # the prompt's frames are never copied: b and c read them in the prompt's tensor
    for other in (b, c):
        assert other.prefix is not None and other.prefix.data_ptr() == prompt.kv.data_ptr()
        assert other.own_frames == other.frames - 8 and other.kv.shape[4] == GROW_FRAMES


def test_room_grows_by_a_quarter_in_steps_and_keeps_the_frames():
    packed = _packed(60, capacity=64)
    packed.store(packed.conv, _frames(10, 60.0))
    assert packed.kv.shape[4] == GROW_FRAMES and packed.frames == 70  # 64 -> max(70, 80) -> 128
    big = _packed(0, capacity=1024)
    big.reserve(1100)
    assert big.kv.shape[4] == 1280  # 1024 + 256, a multiple of 128: spare room < a quarter
    assert torch.equal(packed.kv[0, 0, 0, 0, :70, 0], torch.arange(70, dtype=torch.float32))


def test_the_eager_estimator_gets_the_per_slot_form_back():
    cache = EstimatorCache(frames=6, packed=_packed(6))
    cache.packed.conv = torch.arange(20, dtype=torch.float32).view(2, 5, 2)
    cache.unpack()
    assert cache.packed is None and set(cache.conv_tails) == {0, 1} and set(cache.attention) == {0, 1}
    assert torch.equal(cache.conv_tails[1], torch.arange(20, dtype=torch.float32).view(2, 5, 2)[:, 3:5])
    keys, values = cache.attention[1].keys, cache.attention[1].values
    assert keys is not None and values is not None and cache.attention[1].length == 6
    assert torch.equal(keys[0, 0, :6, 0], torch.arange(6, dtype=torch.float32))


def test_a_prefix_comes_back_as_the_per_slot_prefix():
    prompt = _packed(5)
    first, second = prompt.share(), prompt.share()
    first.store(first.conv, _frames(1, 40.0))  # the writer of the prompt's tensor
    second.store(second.conv, _frames(2, 60.0))  # reads the 5 prompt frames in place
    cache = EstimatorCache(frames=7, packed=second)
    cache.unpack()
    kv = cache.attention[0]
    assert kv.prefix_frames == 5 and kv.length == 2 and kv.frames == 7
    assert kv.prefix_keys is not None and kv.prefix_keys.data_ptr() == prompt.kv.data_ptr()
    assert kv.keys is not None and torch.equal(kv.keys[1, 0, :2, 2], torch.tensor([60.0, 61.0]))
