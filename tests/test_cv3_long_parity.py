"""30 s of CosyVoice3 against the official code (`tests/data/cv3_long_reference.safetensors`, made by
`bench.cv3_long_reference`): the same seeded HiFT noise injected (`hift.set_noise`), PCM compared within
1e-5 in windows at every chunk's start and end, from the first to the 30th second.

* HiFT (f0 -> phase -> excitation -> vocoder) given the official mel: our incremental causal HiFT fed the
  official calls' new frames, and the whole-mel call, equal the official streamed / non-streaming PCM;
* end to end from tokens: the non-streaming token2wav, and the stream with `flow_history="rerun"`
  (upstream's per-call flow re-run), equal the official PCM; the default cached stream gives the
  official mel within 1e-5 (frames of the first and of the final call bit for bit) — its PCM drifts
  from upstream's by the f0 gain of that mel difference (documented in `serve/token2wav_v3.py`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from bench.cv3_long_reference import TOKENS, WINDOW, reference_noise
from voicertc.backends.cosyvoice.hift.causal import HiftStreamState
from voicertc.backends.cosyvoice.serve.streams import token2wav_stream
from voicertc.backends.cosyvoice.serve.token2wav_v3 import whole_utterance_pcm_v3
from voicertc.backends.cosyvoice.voice.voices import voice_from_features
from voicertc.engine import ChunkSchedule

PCM = {"atol": 1e-5, "rtol": 0.0}
REFERENCE = Path(__file__).parent / "data" / "cv3_long_reference.safetensors"
SPF = 480  # samples per mel frame
HELD_BACK = 8  # frames a non-final HiFT call holds back


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def ref():
    return load_file(REFERENCE)


@pytest.fixture(scope="module")
def model(tiny_cv3_model_dir):
    """A tiny v3 model of its own (the session's `cv3_model` keeps the golden noise) with the
    reference's seeded noise."""
    from voicertc.backends.cosyvoice3 import load

    model = load(tiny_cv3_model_dir)
    model.hift.set_noise(*reference_noise(TOKENS * 2 * SPF))
    return model


@pytest.fixture(scope="module")
def voice(model, ref):
    return voice_from_features(model, ref["in_prompt_token"], ref["in_prompt_feat"], ref["in_embedding"])


def windows(pcm: np.ndarray | torch.Tensor, ref: dict) -> torch.Tensor:
    pcm = torch.as_tensor(pcm).reshape(-1)
    assert pcm.shape[0] == TOKENS * 2 * SPF
    return torch.stack([pcm[s : s + WINDOW] for s in ref["window_starts"].tolist()])


def official_mel_chunks(ref: dict) -> list[torch.Tensor]:
    """The new mel frames of each official streamed call (a non-final call yields all but 8 frames)."""
    chunks, start, yielded = [], 0, 0
    samples = ref["stream_chunk_samples"].tolist()
    for k, n in enumerate(samples):
        yielded += n
        end = yielded // SPF + (0 if k == len(samples) - 1 else HELD_BACK)
        chunks.append(ref["stream_mel"][:, :, start:end])
        start = end
    return chunks


def test_incremental_hift_given_the_official_streamed_mel(model, ref):
    state, pcm = HiftStreamState(), []
    chunks = official_mel_chunks(ref)
    for k, mel in enumerate(chunks):
        out, _ = model.hift.step(mel, state, final=k == len(chunks) - 1)
        pcm.append(out[0])
    assert [len(p) for p in pcm] == ref["stream_chunk_samples"].tolist()
    assert_close(windows(torch.cat(pcm), ref), ref["stream_pcm_windows"], **PCM)


def test_whole_hift_given_the_official_nonstreaming_mel(model, ref):
    pcm, _ = model.hift.infer(ref["nonstream_mel"])
    assert_close(windows(pcm, ref), ref["nonstream_pcm_windows"], **PCM)


def test_nonstreaming_end_to_end(model, voice, ref):
    prompt = (voice.flow_prompt_tokens, voice.prompt_feat, voice.embedding)
    pcm, mel = whole_utterance_pcm_v3(model.flow, model.hift, prompt, ref["in_tokens"].long())
    assert_close(mel, ref["nonstream_mel"], atol=0.0, rtol=0.0)
    assert_close(windows(pcm, ref), ref["nonstream_pcm_windows"], **PCM)


def _stream(model, voice, ref, **options) -> list:
    stream = token2wav_stream(model, voice, ChunkSchedule(final_chunk="reference"), **options)
    tokens = ref["in_tokens"][0].tolist()
    chunks = []
    for start in range(0, len(tokens), 40):  # tokens arrive in pieces, as from the LLM
        chunks += stream.push(tokens[start : start + 40])
    return chunks + stream.finish()


def test_streamed_end_to_end_with_the_upstream_flow_rerun(model, voice, ref):
    chunks = _stream(model, voice, ref, flow_history="rerun")
    assert [len(c.pcm) for c in chunks] == ref["stream_chunk_samples"].tolist()
    assert_close(torch.cat([c.mel for c in chunks], dim=2), ref["stream_mel"], atol=0.0, rtol=0.0)
    assert_close(windows(np.concatenate([c.pcm for c in chunks]), ref), ref["stream_pcm_windows"], **PCM)


def test_cached_stream_gives_the_official_mel(model, voice, ref):
    chunks = _stream(model, voice, ref)
    sizes = [c.mel.shape[2] for c in chunks]
    mel = torch.cat([c.mel for c in chunks], dim=2)
    assert_close(mel, ref["stream_mel"], atol=1e-5, rtol=0.0)
    first, last = sizes[0], sizes[-1]
    assert torch.equal(mel[:, :, :first], ref["stream_mel"][:, :, :first])  # the prompt rides with it
    assert torch.equal(mel[:, :, -last:], ref["stream_mel"][:, :, -last:])  # full attention, re-run
    pcm0 = torch.from_numpy(chunks[0].pcm)  # the first call's PCM: both of its windows
    assert len(pcm0) == int(ref["stream_chunk_samples"][0])
    assert_close(torch.stack([pcm0[:WINDOW], pcm0[-WINDOW:]]), ref["stream_pcm_windows"][:2], **PCM)


def test_flow_history_is_checked(model, voice):
    with pytest.raises(ValueError, match="flow_history"):
        token2wav_stream(model, voice, flow_history="whole")
