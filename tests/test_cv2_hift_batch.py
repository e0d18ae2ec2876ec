"""Batched streaming HiFT == each utterance's stream alone (tiny HiFT): per-row mel/source caches and
tails, per-row generators; every streamed chunk of a batched run equals the run alone. Exact to 1e-9 in
float64; in float32 the batched convolutions round differently and the f0 head (gain ~400) turns that
into sample differences of a few 1e-4 (the bound the engine's batched == unbatched test uses too)."""

from __future__ import annotations

import copy

import pytest
import torch

from voicertc.backends.cosyvoice.hift.batch import hift_stream_step_batch, vocoder_frames
from voicertc.backends.cosyvoice.hift.generator import HiftConfig, HiFTGenerator
from voicertc.backends.cosyvoice.hift.stream import hift_stream_step, init_hift_stream_state
from voicertc.backends.cosyvoice.hift.weights import load_hift_file
from voicertc.backends.cosyvoice.load.yaml_config import load_yaml

torch.set_num_threads(2)
TOL = {torch.float64: {"rtol": 0.0, "atol": 1e-9}, torch.float32: {"rtol": 0.0, "atol": 2e-3}}


@pytest.fixture(scope="module")
def hift32(tiny_model_dir, golden_dir) -> HiFTGenerator:
    config = HiftConfig.from_yaml(load_yaml(golden_dir / "model_dir" / "cosyvoice2.yaml")["hift"])
    module = HiFTGenerator(config)
    load_hift_file(module, tiny_model_dir / "hift.pt")
    return module.eval()


@pytest.fixture(scope="module", params=[torch.float64, torch.float32], ids=["float64", "float32"])
def hift(request, hift32) -> HiFTGenerator:
    return hift32 if request.param == torch.float32 else copy.deepcopy(hift32).double()


def _dtype(hift) -> torch.dtype:
    return hift.conv_pre.weight.dtype


CHUNKS = [20, 14, 12]  # new mel frames per chunk; the last one is final


def _mels(seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 80, n, generator=gen) - 4.0).to(dtype) for n in CHUNKS]


def _alone(hift, mels, seed):
    state, gen = init_hift_stream_state(), torch.Generator().manual_seed(seed)
    return [
        hift_stream_step(hift, mel, state, i == len(mels) - 1, generator=gen) for i, mel in enumerate(mels)
    ]


def test_batched_stream_equals_each_stream_alone(hift):
    seeds = [3, 4, 5]
    mels = [_mels(100 + s, _dtype(hift)) for s in seeds]
    states = [init_hift_stream_state() for _ in seeds]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    got: list[list[torch.Tensor]] = [[] for _ in seeds]
    for i in range(len(CHUNKS)):
        assert len({vocoder_frames(s, CHUNKS[i]) for s in states}) == 1
        final = i == len(CHUNKS) - 1
        out = hift_stream_step_batch(hift, [m[i] for m in mels], states, [final] * 3, gens)
        for row, pcm in enumerate(out):
            got[row].append(pcm)
    for row, seed in enumerate(seeds):
        expected = _alone(hift, mels[row], seed)
        for a, b in zip(expected, got[row], strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(b, a, **TOL[_dtype(hift)])
        assert states[row].finished and states[row].mel_cache is None
    assert not torch.allclose(got[0][1], got[1][1])  # own excitation per row


def test_a_batch_of_other_lengths_is_refused(hift):
    states = [init_hift_stream_state(), init_hift_stream_state()]
    with pytest.raises(ValueError, match="one length"):
        hift_stream_step_batch(
            hift, [torch.zeros(1, 80, 20), torch.zeros(1, 80, 24)], states, [False, False], [None, None]
        )
