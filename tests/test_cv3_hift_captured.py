"""CosyVoice3's causal HiFT synthesis as captured static-shape steps (`hift.captured_causal`, what
`[engine] cuda_graphs` replays on CUDA), on the CPU with a capture that keeps what a CUDA graph keeps:
the step runs on the state rebuilt from the counters of the call that made its bucket, never the
current call's. So a stream through the replays equals the eager stream, and a second stream at other
absolute positions (other counters) replaying the first stream's buckets equals its own eager run: the
phase key holds everything the kernels depend on. Rows padded to a bucket equal each row alone; more
rows than the cap, past the budget or a final chunk run eagerly, counted; the warm-up captures the
phases the engine's schedule meets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from voicertc.backends.cosyvoice.accel.captured import GraphBudget
from voicertc.backends.cosyvoice.accel.tape import TapeCapture
from voicertc.backends.cosyvoice.hift.captured_causal import CapturedCausalHift
from voicertc.backends.cosyvoice.hift.causal import HiftStreamState
from voicertc.backends.cosyvoice.hift.causal_batch import step_batch
from voicertc.engine import ChunkSchedule

REFERENCE = Path(__file__).parent / "data" / "cv3_long_reference.safetensors"
CHUNKS = [58, 100, 100, 100, 40]  # new mel frames per chunk; the last one is final
PCM = {"atol": 1e-5, "rtol": 0.0}  # batched convolutions round differently (as test_cv3_hift_batch)


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def hift(cv3_model):
    return cv3_model.hift


@pytest.fixture(scope="module")
def long_mel():
    return load_file(REFERENCE)["stream_mel"]


def _pieces(long_mel, start: int, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(long_mel[:, :, start : start + sum(sizes)], sizes, dim=2))


def _stream(hift, pieces, state: HiftStreamState | None = None) -> list[torch.Tensor]:
    state = state or HiftStreamState()
    return [hift.step(p, state, final=i == len(pieces) - 1)[0][0] for i, p in enumerate(pieces)]


def _installed(hift, runner):
    hift.synthesis_runner = runner
    return runner


def test_a_stream_through_the_replays_equals_the_eager_stream(hift, long_mel):
    pieces = _pieces(long_mel, 0, CHUNKS)
    eager = _stream(hift, pieces)
    capture = TapeCapture()
    runner = _installed(hift, CapturedCausalHift(hift, capture=capture))
    try:
        got = _stream(hift, pieces)
    finally:
        hift.synthesis_runner = None
    for a, b in zip(eager, got, strict=True):
        assert b.shape == a.shape
        assert_close(b, a, atol=0.0, rtol=0.0)  # one row, the same kernels: bit for bit
    # the chunks of 100 frames after the first one meet one phase: captured once, replayed; the final
    # chunk runs eagerly
    assert capture.captured == len(runner.stats.by_shape) < len(CHUNKS) - 1
    assert runner.stats.replays == len(CHUNKS) - 1 and runner.stats.eager == 1


def test_another_stream_replays_buckets_made_at_other_positions(hift, long_mel):
    """Stream B runs 3 chunks of 100 first; its chunks 4-6 replay buckets that stream A made at A's
    chunks 2-4 (other mel frames, emitted samples, overlap-add start: other counters)."""
    sizes_a, sizes_b = [58, 100, 100, 100, 40], [58, 100, 100, 100, 100, 100, 40]
    pa, pb = _pieces(long_mel, 300, sizes_a), _pieces(long_mel, 900, sizes_b)
    eager_b = _stream(hift, pb)
    capture = TapeCapture()
    runner = _installed(hift, CapturedCausalHift(hift, capture=capture))
    try:
        _stream(hift, pa)
        made = capture.captured
        state_b = HiftStreamState()
        for k in range(3):
            hift.step(pb[k], state_b, final=False)  # the phases of 58 and 100 frames: A's buckets
        got = [hift.step(pb[k], state_b, final=k == len(pb) - 1)[0][0] for k in range(3, len(pb))]
    finally:
        hift.synthesis_runner = None
    assert capture.captured == made  # every bucket B met was made by A
    for a, b in zip(eager_b[3:], got, strict=True):
        assert_close(b, a, atol=0.0, rtol=0.0)
    assert runner.stats.replays == len(sizes_a) + len(sizes_b) - 2 and runner.stats.eager == 2


def test_three_rows_in_a_four_row_bucket_equal_each_row_alone(hift, long_mel):
    starts = [100, 500, 1000]
    pieces = [_pieces(long_mel, s, CHUNKS) for s in starts]
    alone = [_stream(hift, p) for p in pieces]
    runner = _installed(hift, CapturedCausalHift(hift))
    try:
        states = [HiftStreamState() for _ in starts]
        got: list[list[torch.Tensor]] = [[] for _ in starts]
        for k in range(len(CHUNKS)):
            out = step_batch(hift, [p[k] for p in pieces], states, final=k == len(CHUNKS) - 1)
            for row, pcm in enumerate(out):
                got[row].append(pcm)
    finally:
        hift.synthesis_runner = None
    assert {key[0] for key in runner.stats.by_shape} == {4} and runner.stats.eager == 1  # the final
    for row in range(len(starts)):
        for a, b in zip(alone[row], got[row], strict=True):
            assert_close(b, a, **PCM)
    assert all(s.finished and not s.tails and not s.pending and s.pcm is None for s in states)


def test_past_the_budget_or_the_rows_it_runs_eagerly_and_is_counted(hift, long_mel):
    pieces = _pieces(long_mel, 600, CHUNKS)
    eager = _stream(hift, pieces)
    capture = TapeCapture()
    starved = CapturedCausalHift(hift, capture=capture, budget=GraphBudget(limit_bytes=1024))
    _installed(hift, starved)
    try:
        got = _stream(hift, pieces)
        narrow = _installed(hift, CapturedCausalHift(hift, max_rows=1))
        out = step_batch(hift, [pieces[0], pieces[0]], [HiftStreamState(), HiftStreamState()], final=False)
    finally:
        hift.synthesis_runner = None
    assert capture.captured == 0 and starved.stats.eager == len(CHUNKS) and starved.stats.replays == 0
    for a, b in zip(eager, got, strict=True):
        assert_close(b, a, atol=0.0, rtol=0.0)
    assert narrow.stats.eager == 1 and narrow.stats.replays == 0
    assert_close(out[0], eager[0], **PCM)


def test_the_warm_up_captures_the_phases_of_the_schedules_first_chunks(hift, long_mel):
    schedule = ChunkSchedule()
    sizes = [2 * schedule.hop_tokens(i) for i in range(4)]
    capture = TapeCapture()
    runner = _installed(hift, CapturedCausalHift(hift, capture=capture))
    try:
        made = runner.warm(sizes, [1, 2], torch.zeros(1))
        assert made == capture.captured > 0
        pieces = _pieces(long_mel, 150, sizes)
        pair, one = [HiftStreamState(), HiftStreamState()], HiftStreamState()
        for piece in pieces:
            step_batch(hift, [piece, piece], pair, final=False)
            hift.step(piece, one, final=False)
    finally:
        hift.synthesis_runner = None
    assert capture.captured == made  # nothing captured at call time
    assert runner.stats.replays == 2 * 2 * len(sizes) and runner.stats.eager == 0  # warm-up's + the calls'
