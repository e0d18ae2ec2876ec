"""The flow's token encoder as static-shape steps (what `[engine] cuda_graphs` captures on CUDA): the padded
static step equals the eager encoder chunk by chunk (rows padded, the chunk's tokens padded with the
lookahead kept next to the real ones, cached tokens padded and hidden, a voice's prompt prefix, the final
chunk without lookahead), rows at different positions run one by one, a chunk outside every bucket runs
eagerly (counted), and warm-up captures every bucket it is given."""

from __future__ import annotations

import pytest
import torch
from flow_stream_helpers import GRID, LOOKAHEAD, golden_flow_voice, two_utterances

from voicertc.backends.cosyvoice.accel.tape import TapeCapture
from voicertc.backends.cosyvoice.flow.captured import Buckets, StepShape
from voicertc.backends.cosyvoice.flow.captured_encoder import CapturedEncoder, positions
from voicertc.backends.cosyvoice.flow.flow import CausalFlow

TOL = 1e-5
ROWS = 3


def _runner(flow: CausalFlow, max_keys: int = 256, capture=None) -> CapturedEncoder:
    buckets = Buckets(max_rows=4, key_quantum=16, max_keys=max_keys, frame_buckets=(32, 64), smallest_rows=1)
    return CapturedEncoder(flow.encoder, buckets=buckets, capture=capture or TapeCapture())


def _stream(
    flow: CausalFlow, tts_golden, rows: int, hops: list[int], runner, forked: bool = False
) -> list[torch.Tensor]:
    """`rows` utterances (different tokens) on the golden voice, streamed together; mel per row.
    `forked`: the voice has an encoded history first (as a longer prompt has), so every utterance's
    caches start with it as a read-only prefix (`KVCache.fork`)."""
    flow.encoder_runner = runner
    try:
        voice = golden_flow_voice(flow, tts_golden)
        pad = -tts_golden["in_prompt_token"].shape[1] % GRID
        if forked:
            flow.stream_step(tts_golden["in_token"][:, : pad + 25 + LOOKAHEAD], voice, finalize=False)
            pad = 0
        states = [voice.clone() for _ in range(rows)]
        speech = [torch.roll(tts_golden["in_token"], shifts=7 * r, dims=1) for r in range(rows)]
        outs: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        offset = 0
        for index, hop in enumerate(hops):
            hop += pad if index == 0 else 0
            pieces = [s[:, offset : offset + hop + LOOKAHEAD] for s in speech]
            for r, mel in enumerate(flow.stream_step_batch(pieces, states, finalize=False)):
                outs[r].append(mel)
            offset += hop
        tails = [s[:, offset : offset + 11] for s in speech]
        for r, mel in enumerate(flow.stream_step_batch(tails, states, finalize=True)):
            outs[r].append(mel)
        return [torch.cat(o, dim=2) for o in outs]
    finally:
        flow.encoder_runner = None


@pytest.mark.parametrize("forked", [False, True], ids=["fresh", "voice-prefix"])
@pytest.mark.parametrize("rows", [1, ROWS])
def test_streamed_chunks_through_the_static_encoder_equal_the_eager_encoder(flow, tts_golden, rows, forked):
    hops = [25, 50]
    eager = _stream(flow, tts_golden, rows, hops, None, forked)
    runner = _runner(flow)
    static = _stream(flow, tts_golden, rows, hops, runner, forked)
    for r in range(rows):
        assert static[r].shape == eager[r].shape
        assert (static[r] - eager[r]).abs().max().item() <= TOL
    if rows > 1:
        assert (eager[0] - eager[1]).abs().max().item() > 1e-3  # the rows really differ
    stats = runner.stats
    # every chunk, the final one too (and the history of the forked voice)
    assert stats.eager == 0 and stats.replays == len(hops) + 1 + forked
    row_buckets = {key[0] for key in stats.by_shape}  # rows padded to their bucket (the voice's: 1)
    assert row_buckets == ({1} if rows == 1 else {4} | ({1} if forked else set()))
    # the chunks' tokens were padded (no chunk here is a bucket's exact length)
    assert runner.buckets.frames(hops[1]) > hops[1]
    # the voice's history (each row's own fork of it) packed once per stage, for every chunk
    assert len(runner._prefix_packs) == (2 if forked else 0)


def test_rows_at_different_positions_run_one_by_one_and_equal_the_eager_encoder(flow, tts_golden):
    eager = two_utterances(flow, tts_golden)
    runner = _runner(flow)
    flow.encoder_runner = runner
    try:
        static = two_utterances(flow, tts_golden)
    finally:
        flow.encoder_runner = None
    for got, want in zip(static, eager, strict=True):
        assert got.shape == want.shape and (got - want).abs().max().item() <= TOL
    assert runner.stats.eager == 0 and runner.stats.replays >= 5


def test_a_history_past_every_key_bucket_runs_eagerly_and_is_counted(flow, tts_golden):
    eager = _stream(flow, tts_golden, 1, [25, 50], None)
    runner = _runner(flow, max_keys=32)  # the prompt alone outgrows it by the second chunk
    static = _stream(flow, tts_golden, 1, [25, 50], runner)
    assert (static[0] - eager[0]).abs().max().item() <= TOL
    assert runner.stats.eager >= 1 and runner.stats.replays >= 1


def test_padded_positions_hide_padding_and_index_the_real_relative_positions():
    shape = StepShape(rows=1, frames=8, keys=8)
    pos = positions(
        5, 6, shape, 2, 25, final=True, lookahead=3, dtype=torch.float32, device=torch.device("cpu")
    )
    bias, index = pos.bias_tokens[0, 0], pos.index_tokens[0, 0]
    assert bias.shape == (8, 16) and index.shape == (8, 16)
    real = bias[:6]
    assert torch.isinf(real[:, 5:8]).all() and torch.isinf(real[:, 14:]).all()  # hidden padding
    assert (real[:, :5] == 0).all() and (real[:, 8:14] == 0).all()  # one grid chunk: all visible
    assert torch.isfinite(bias[6:]).all()  # padded queries compute finite values
    window_top = 8 + 8 - 1  # the window's first row is relative position keys + frames - 1
    for i in range(6):
        for j in range(5):  # cached key j at position j
            assert window_top - index[i, j] == (5 + i) - j
        for j in range(6):  # the chunk's key j at position 5 + j
            assert window_top - index[i, 8 + j] == i - j
    assert (pos.keep[0, 6:9, 0] == 0).all() and (pos.keep[0, :6, 0] == 1).all()  # no lookahead at the end
    assert pos.tail_index.tolist() == [[6, 7]]
    assert pos.bias_frames.shape[-2:] == (16, 32)


def test_warm_up_captures_every_bucket_given_once(flow):
    capture = TapeCapture()
    runner = _runner(flow, capture=capture)
    like = torch.zeros(1)
    assert runner.warm([1, 2], [32, 64], [16, 32], like) == 8
    assert capture.captured == 8
    assert runner.warm([1, 2], [32, 64], [16, 32], like) == 0  # captured already
