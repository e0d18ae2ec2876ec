"""The flow step's cached keys and values written straight into its static buffer (`flow.graph.PackedKV`,
`accel.captured.FillsBuffer`): each group's frames (a shared prompt prefix, then its own) land where
`pack_caches`'s concatenation puts them, positions past them are left as the buffer holds them, and a
batch of utterances through the static steps never makes the whole packed K/V as a tensor of its own
(it was made by concatenating every group's context, then copied into the buffer), and the step's new
K/V come back as a view of the room its input keeps for them."""

from __future__ import annotations

import torch
from flow_stream_helpers import golden_flow_voice, two_utterances
from torch.utils._python_dispatch import TorchDispatchMode

from voicertc.backends.cosyvoice.flow.captured import Buckets, CapturedEstimator
from voicertc.backends.cosyvoice.flow.graph import PackedKV, StreamingEstimator
from voicertc.backends.cosyvoice.flow.unet import GROW_FRAMES, PackedCache

SLOTS = ((0, 3),)
SENTINEL = -7.0


def _context(frames: int, first: float) -> PackedCache:
    kv = torch.zeros(3, 2, 2, 2, 64, 4)
    kv[..., :frames, :] = (first + torch.arange(frames, dtype=torch.float32))[:, None]
    return PackedCache(torch.zeros(2, 3, 2), kv, frames, SLOTS)


def _groups() -> list[PackedCache]:
    prompt = _context(8, 0.0)
    speaking = prompt.share()
    speaking.store(speaking.conv, torch.full((3, 2, 2, 2, 3, 4), 50.0))  # the prompt's writer now
    forked = prompt.share()
    forked.store(forked.conv, torch.full((3, 2, 2, 2, 5, 4), 70.0))  # the prompt becomes its prefix
    assert forked.prefix is not None and speaking.prefix is None
    return [speaking, forked, prompt.share(), _context(12, 100.0)]


def test_each_group_lands_where_the_concatenated_contexts_put_it():
    groups = _groups()
    kv = PackedKV(tuple(groups), rows=2, keys=16, dtype=torch.float32)
    assert kv.shape == torch.Size((3, 2, 8, 2, 16, 4)) and kv.element_size() == 4
    out = torch.full(kv.shape, SENTINEL)
    kv.fill(out)
    for g, packed in enumerate(groups):
        for p in groups:
            p.reserve(16)  # (what `pack_caches` does before taking its views)
        expected = packed.context(16)[..., : packed.frames, :]
        got = out[:, :, 2 * g : 2 * g + 2]
        assert torch.equal(got[..., : packed.frames, :], expected)
        assert bool((got[..., packed.frames :, :] == SENTINEL).all())  # left as the buffer held it
    made = kv.tensor()
    assert torch.equal(made[out != SENTINEL], out[out != SENTINEL])
    assert bool((made[out == SENTINEL] == 0).all())


class _Shapes(TorchDispatchMode):
    """Every tensor an op makes, by op and shape (views and in-place results, which alias an input, left
    out)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, tuple[int, ...]]] = []  # (op, shape)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat = [*args, *kwargs.values()]
        given = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor)}
        for value in out if isinstance(out, tuple | list) else [out]:
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in given:
                self.made.append((func.__name__, tuple(value.shape)))
        return out


def test_a_batch_through_the_static_steps_never_makes_the_whole_packed_context(flow, tts_golden):
    runner = CapturedEstimator(StreamingEstimator(flow.decoder.estimator), buckets=Buckets(max_rows=8))
    flow.decoder.estimator_runner = runner
    try:
        first = two_utterances(flow, tts_golden)  # makes the buckets (static buffers, first runs)
        shapes = _Shapes()
        with shapes:
            again = two_utterances(flow, tts_golden)
    finally:
        flow.decoder.estimator_runner = None
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    four_rows = [key for key in runner.stats.by_shape if key[0] == 4]
    assert four_rows and runner.stats.eager == 0  # the two utterances' shared calls replayed 4-row buckets
    # each bucket's kv_cache input (position 6; the bucket key leaves its row dimension, 2, out)
    whole = {(*key[7][:2], 4, *key[7][2:]) for key in four_rows}  # what the concatenation made
    assert all(len(shape) == 6 for shape in whole)
    assert not whole & {shape for op, shape in shapes.made if op == "cat.default"}
    # (only a `cat` would: the step's kv_new [A, 2, rows, H, frames, Dh] has that shape too where the
    # frame and key buckets are equal)
    # the new frames' K/V come back as a view of the room in the static input: no static output buffer
    # of their own, no clone; they are copied once, into each utterance's context
    new_kv = {(*key[7][:2], 4, key[7][2], key[1][1], key[7][4]) for key in four_rows}
    assert not new_kv & {shape for op, shape in shapes.made if op == "clone.default"}
    assert {position for position, _, _ in runner.steps._out_buffers} == {0, 1}  # velocity, conv tails


def test_an_utterance_holds_room_for_its_own_frames_not_for_the_key_bucket(flow, tts_golden):
    """The static step reads the frames where they are: an utterance's own K/V room grows with its
    frames (a quarter at a time), not up to the padded key bucket of its step (up to twice its frames)."""
    runner = CapturedEstimator(
        StreamingEstimator(flow.decoder.estimator), buckets=Buckets(max_rows=8, key_quantum=256)
    )
    tokens, state = tts_golden["in_token"], golden_flow_voice(flow, tts_golden).clone()
    first = 25 - tts_golden["in_prompt_token"].shape[1] % 25 + 25
    flow.decoder.estimator_runner = runner
    try:
        flow.stream_step(tokens[:, : first + 3], state, finalize=False)
    finally:
        flow.decoder.estimator_runner = None
    caches = [cache.packed for cache in state.estimator]
    assert caches and all(packed is not None for packed in caches)
    for packed in caches:
        assert packed is not None and packed.prefix_frames < 256  # its steps padded the keys to 256
        assert 0 < packed.own_frames <= packed.kv.shape[4] <= max(GROW_FRAMES, packed.own_frames * 5 // 4)
