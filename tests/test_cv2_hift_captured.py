"""HiFT's generator network as static-shape steps (what `[engine] cuda_graphs` captures on CUDA): a
streamed utterance through the captured decode equals the eager one (float64: exact), a batch of 3 rows
padded to a 4-row bucket equals the rows alone, a bucket is captured once and replayed, and the shared
memory budget sends what does not fit to the eager path, counted."""

from __future__ import annotations

import copy

import pytest
import torch

from voicertc.backends.cosyvoice.accel.captured import GraphBudget, row_bucket
from voicertc.backends.cosyvoice.accel.tape import TapeCapture
from voicertc.backends.cosyvoice.hift.batch import hift_stream_step_batch
from voicertc.backends.cosyvoice.hift.captured import CapturedHiftDecode
from voicertc.backends.cosyvoice.hift.generator import HiftConfig, HiFTGenerator
from voicertc.backends.cosyvoice.hift.stream import hift_stream_step, init_hift_stream_state
from voicertc.backends.cosyvoice.hift.weights import load_hift_file
from voicertc.backends.cosyvoice.load.yaml_config import load_yaml

torch.set_num_threads(2)
CHUNKS = [20, 14, 12]  # new mel frames per chunk; the last one is final


@pytest.fixture(scope="module")
def hift(tiny_model_dir, golden_dir) -> HiFTGenerator:
    config = HiftConfig.from_yaml(load_yaml(golden_dir / "model_dir" / "cosyvoice2.yaml")["hift"])
    module = HiFTGenerator(config)
    load_hift_file(module, tiny_model_dir / "hift.pt")
    return copy.deepcopy(module.eval()).double()  # float64: static == eager to the last bit


def _mels(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 80, n, generator=gen) - 4.0).double() for n in CHUNKS]


def _stream(hift, mels, seed) -> list[torch.Tensor]:
    state, gen = init_hift_stream_state(), torch.Generator().manual_seed(seed)
    return [hift_stream_step(hift, m, state, i == len(mels) - 1, generator=gen) for i, m in enumerate(mels)]


def test_row_buckets_are_powers_of_two_up_to_the_cap():
    assert [row_bucket(n, 32) for n in (1, 2, 3, 5, 16, 17, 32)] == [1, 2, 4, 8, 16, 32, 32]
    assert row_bucket(33, 32) is None and row_bucket(3, 12, smallest=2) == 4 and row_bucket(9, 12) == 12


def test_a_streamed_utterance_through_the_captured_decode_equals_eager(hift):
    mels = _mels(7)
    eager = _stream(hift, mels, 7)
    capture = TapeCapture()
    hift.decode_runner = runner = CapturedHiftDecode(hift, capture=capture)
    try:
        got = _stream(hift, mels, 7)
        again = _stream(hift, mels, 7)
    finally:
        hift.decode_runner = None
    for a, b, c in zip(eager, got, again, strict=True):
        torch.testing.assert_close(b, a, rtol=0.0, atol=1e-12)
        torch.testing.assert_close(c, a, rtol=0.0, atol=1e-12)
    shapes = {20, 8 + 14, 8 + 12}  # vocoder input frames: the 8 cached frames + the new ones (20 twice)
    assert capture.captured == len(shapes) == len(runner.stats.by_shape)  # once per shape
    assert runner.stats.replays == 2 * len(CHUNKS)


def test_three_rows_in_a_four_row_bucket_equal_each_row_alone(hift):
    seeds = [3, 4, 5]
    mels = [_mels(100 + s) for s in seeds]
    hift.decode_runner = runner = CapturedHiftDecode(hift)
    try:
        states = [init_hift_stream_state() for _ in seeds]
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        got: list[list[torch.Tensor]] = [[] for _ in seeds]
        for i in range(len(CHUNKS)):
            final = i == len(CHUNKS) - 1
            for row, pcm in enumerate(
                hift_stream_step_batch(hift, [m[i] for m in mels], states, [final] * 3, gens)
            ):
                got[row].append(pcm)
    finally:
        hift.decode_runner = None
    assert {key[0] for key in runner.stats.by_shape} == {4}
    for row, seed in enumerate(seeds):
        for a, b in zip(_stream(hift, mels[row], seed), got[row], strict=True):
            torch.testing.assert_close(b, a, rtol=0.0, atol=1e-9)


def test_past_the_budget_or_the_rows_it_runs_eagerly_and_is_counted(hift):
    mels = _mels(9)
    eager = _stream(hift, mels, 9)
    capture = TapeCapture()
    starved = CapturedHiftDecode(hift, capture=capture, budget=GraphBudget(limit_bytes=1024))
    hift.decode_runner = starved
    try:
        got = _stream(hift, mels, 9)
    finally:
        hift.decode_runner = None
    assert capture.captured == 0 and starved.stats.eager == len(CHUNKS) and starved.stats.replays == 0
    for a, b in zip(eager, got, strict=True):  # the stage's conv STFT pair vs torch's, float64
        torch.testing.assert_close(b, a, rtol=0.0, atol=1e-12)
    narrow = CapturedHiftDecode(hift, max_rows=1)
    out = narrow(torch.zeros(2, 80, 10, dtype=torch.float64), torch.zeros(2, 1, 4800, dtype=torch.float64))
    assert out.shape == (2, 4800) and narrow.stats.eager == 1
