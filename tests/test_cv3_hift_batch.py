"""Batched incremental causal HiFT (CosyVoice3) == each stream alone: rows in one stream phase share a
forward (`hift.causal_batch.step_batch`), each with its own conv tails, phase sum and noise position —
also rows at different points of their utterances; rows in other phases are refused untouched; the
token2wav streams vocode as one batch (`vocode_batch_v3`) and the cosyvoice3 engine batches them.

float32: the batched convolutions round differently from batch-of-one ones (measured <= 3e-6 here);
the f0 predictor runs in float64, so the excitation phase does not amplify it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from voicertc.backends.cosyvoice.hift.causal import HiftStreamState
from voicertc.backends.cosyvoice.hift.causal_batch import phase_key, step_batch
from voicertc.backends.cosyvoice.serve.streams import token2wav_stream
from voicertc.backends.cosyvoice.serve.token2wav_v3 import vocode_batch_v3
from voicertc.backends.cosyvoice.voice.voices import voice_from_features
from voicertc.engine import ChunkSchedule

PCM = {"atol": 1e-5, "rtol": 0.0}
REFERENCE = Path(__file__).parent / "data" / "cv3_long_reference.safetensors"
CHUNKS = [58, 100, 100, 40]  # new mel frames per chunk (the official v3 plan's first two); the last is final


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def hift(cv3_model):
    return cv3_model.hift


@pytest.fixture(scope="module")
def long_mel():
    """30 s of the official code's mel (the long parity vector): realistic f0, voiced and unvoiced."""
    return load_file(REFERENCE)["stream_mel"]


def _mel(long_mel: torch.Tensor, seed: int, frames: int) -> torch.Tensor:
    start = 100 * seed  # a different stretch per row
    return long_mel[:, :, start : start + frames]


def _pieces(mel: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(mel, sizes, dim=2))


def _alone(hift, mel: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    state = HiftStreamState()
    pieces = _pieces(mel, sizes)
    return [hift.step(p, state, final=i == len(pieces) - 1)[0][0] for i, p in enumerate(pieces)]


def test_rows_batched_from_the_start_equal_each_row_alone(hift, long_mel):
    mels = [_mel(long_mel, 1, sum(CHUNKS)), _mel(long_mel, 2, sum(CHUNKS)), _mel(long_mel, 3, sum(CHUNKS))]
    alone = [_alone(hift, m, CHUNKS) for m in mels]
    states = [HiftStreamState() for _ in mels]
    pieces = [_pieces(m, CHUNKS) for m in mels]
    for k in range(len(CHUNKS)):
        out = step_batch(hift, [p[k] for p in pieces], states, final=k == len(CHUNKS) - 1)
        for row, pcm in enumerate(out):
            assert pcm.shape == alone[row][k].shape
            assert_close(pcm, alone[row][k], **PCM)
    assert all(s.finished for s in states)


def test_rows_at_different_points_of_their_utterances_batch(hift, long_mel):
    """Row A is at its 3rd chunk (158 frames done), row B at its 5th (358 frames): same phase."""
    sizes_a, sizes_b = [58, 100, 100, 100, 40], [58, 100, 100, 100, 100, 100, 40]
    mel_a, mel_b = _mel(long_mel, 4, sum(sizes_a)), _mel(long_mel, 5, sum(sizes_b))
    ref_a, ref_b = _alone(hift, mel_a, sizes_a), _alone(hift, mel_b, sizes_b)
    pa, pb = _pieces(mel_a, sizes_a), _pieces(mel_b, sizes_b)
    sa, sb = HiftStreamState(), HiftStreamState()
    for k in range(2):
        hift.step(pa[k], sa, final=False)
    for k in range(4):
        hift.step(pb[k], sb, final=False)
    assert sa.mel_frames != sb.mel_frames
    assert phase_key(hift, sa, 100, False) == phase_key(hift, sb, 100, False)
    for ka, kb in [(2, 4), (3, 5), (4, 6)]:
        final = ka == 4
        out_a, out_b = step_batch(hift, [pa[ka], pb[kb]], [sa, sb], final=final)
        assert_close(out_a, ref_a[ka], **PCM)
        assert_close(out_b, ref_b[kb], **PCM)
    assert sa.emitted == 480 * sum(sizes_a) and sb.emitted == 480 * sum(sizes_b)


def test_rows_in_other_phases_are_refused_and_left_untouched(hift, long_mel):
    mel = _mel(long_mel, 6, 158)
    fresh, started = HiftStreamState(), HiftStreamState()
    hift.step(mel[:, :, :58], started, final=False)
    before = (started.mel_frames, started.emitted, dict(started.tails), started.source.frames)
    with pytest.raises(ValueError, match="phase"):
        step_batch(hift, [mel[:, :, :100], mel[:, :, 58:]], [fresh, started], final=False)
    assert (started.mel_frames, started.emitted, dict(started.tails), started.source.frames) == before
    assert fresh.mel_frames == 0 and not fresh.tails
    with pytest.raises(ValueError, match="phase"):  # same state, other chunk length
        step_batch(
            hift, [mel[:, :, :50], mel[:, :, :58]], [HiftStreamState(), HiftStreamState()], final=False
        )


def _voice(model, seed: int):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 6561, (1, 21), generator=gen)
    return voice_from_features(
        model, prompt, torch.randn(1, 42, 80, generator=gen) - 3, torch.randn(1, 192, generator=gen)
    )


def test_token2wav_streams_vocode_as_one_batch(cv3_model):
    """Two utterances (own voices, own tokens) in lockstep: flow per stream, HiFT as one batch."""
    gen = torch.Generator().manual_seed(9)
    tokens = [torch.randint(0, 6561, (100,), generator=gen).tolist() for _ in range(2)]
    voices = [_voice(cv3_model, 10), _voice(cv3_model, 11)]
    alone = []
    for voice, toks in zip(voices, tokens, strict=True):
        stream = token2wav_stream(cv3_model, voice, ChunkSchedule())
        alone.append([c.pcm for c in stream.push(toks) + stream.finish()])
    streams = [token2wav_stream(cv3_model, v, ChunkSchedule()) for v in voices]
    for stream, toks in zip(streams, tokens, strict=True):
        stream.add_tokens(toks)
    batched: list[list[np.ndarray]] = [[], []]
    batches = 0
    while not streams[0].finished:
        plans = [s.plan() or s.plan(final=True) for s in streams]
        mels = [s.flow_mel(p) for s, p in zip(streams, plans, strict=True)]  # type: ignore[arg-type]
        assert len({s.hift_phase(p, m) for s, p, m in zip(streams, plans, mels, strict=True)}) == 1
        chunks = vocode_batch_v3(streams, plans, mels, [0.0, 0.0])  # type: ignore[arg-type]
        batches += 1
        for row, chunk in enumerate(chunks):
            batched[row].append(chunk.pcm)
    assert batches == len(alone[0]) >= 3 and all(s.finished for s in streams)
    for row in range(2):
        assert [len(p) for p in batched[row]] == [len(p) for p in alone[row]]
        for got, want in zip(batched[row], alone[row], strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
