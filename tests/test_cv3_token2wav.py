"""Token2WavStreamV3: the official v3 streaming chunk sequence (`cv3_tts_stream`) from pushed tokens, the
PCM length contract, the final-chunk modes, and a per-chunk cost that stays flat (work, not time)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from voicertc.backends.cosyvoice.serve.streams import token2wav_stream
from voicertc.backends.cosyvoice.voice.voices import voice_from_features
from voicertc.engine import ChunkSchedule

MEL = {"atol": 1e-4, "rtol": 1e-4}
SPEECH = {"atol": 1e-5, "rtol": 0.0}
E2E = {"atol": 5e-3, "rtol": 0.0}  # the README's end-to-end tolerance (f0 has a high gain)
OFFSETS = (0, 29, 79)  # token_offset of the official calls (prompt pad 4, hops 25, 50, rest)


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tts(cv3_records):
    return cv3_records("cv3_tts_stream.safetensors")


@pytest.fixture(scope="module")
def voice(cv3_model, tts):
    return voice_from_features(cv3_model, tts["in_prompt_token"], tts["in_prompt_feat"], tts["in_embedding"])


def _pushed(stream, tokens, step):
    chunks = []
    for start in range(0, tokens.shape[1], step):
        chunks += stream.push(tokens[0, start : start + step])
    return chunks + stream.finish()


def test_official_stream_chunks_with_the_reference_final_chunk(cv3_model, voice, tts):
    source = lambda k: tts[f"stream_call{k}_hift_source"]  # noqa: E731 - the re-run's whole source
    stream = token2wav_stream(cv3_model, voice, ChunkSchedule(final_chunk="reference"), source_fn=source)
    chunks = _pushed(stream, tts["in_token"], 7)
    assert [c.mel.shape[2] for c in chunks] == [58, 100, 82]
    assert [len(c.pcm) for c in chunks] == [24000, 48000, 43200]
    for k, chunk in enumerate(chunks):
        assert_close(chunk.mel, tts[f"stream_call{k}_flow_mel_full"][:, :, 2 * OFFSETS[k] :], **MEL)
        assert chunk.pcm.dtype == np.float32 and chunk.final == (k == 2)
        assert_close(torch.from_numpy(chunk.pcm), tts[f"stream_call{k}_yield_speech"][0], **SPEECH)


def test_official_stream_end_to_end_with_the_injected_noise(cv3_model, voice, tts):
    stream = token2wav_stream(cv3_model, voice, ChunkSchedule(final_chunk="reference"))
    chunks = _pushed(stream, tts["in_token"], 120)
    for k, chunk in enumerate(chunks):
        assert_close(torch.from_numpy(chunk.pcm), tts[f"stream_call{k}_yield_speech"][0], **E2E)


def test_pcm_length_contract_and_range(cv3_model, voice, tts):
    stream = token2wav_stream(cv3_model, voice, ChunkSchedule(first_hop_tokens=5, grid_tokens=25))
    frames = samples = 0
    tokens = tts["in_token"][0].tolist()
    for start in range(0, len(tokens), 3):
        for chunk in stream.push(tokens[start : start + 3]):
            frames += chunk.mel.shape[2]
            samples += len(chunk.pcm)
            assert samples == 480 * (frames - 8)
            assert chunk.pcm.dtype == np.float32 and np.abs(chunk.pcm).max() <= 1.0
    for chunk in stream.finish():
        frames += chunk.mel.shape[2]
        samples += len(chunk.pcm)
    assert frames == 240 and samples == 480 * frames


def test_chunk_mask_final_chunk_gives_the_chunk_masked_mel(cv3_model, voice, tts, cv3_records):
    stream = token2wav_stream(cv3_model, voice, ChunkSchedule())
    chunks = _pushed(stream, tts["in_token"], 50)
    mel = torch.cat([c.mel for c in chunks], dim=2)
    assert_close(mel, cv3_records("flow_nonstream.safetensors")["chunkmask_mel"], **MEL)
    assert stream.flow_state is None and stream.hift_state is None  # released after the final chunk
    with pytest.raises(ValueError, match="final_chunk"):
        ChunkSchedule(final_chunk="whole")  # type: ignore[arg-type]


def _frames_per_chunk(cv3_model, voice, tokens: torch.Tensor) -> list[tuple[int, int]]:
    """(flow estimator frames, HiFT mel frames) processed by each chunk of an incremental stream."""
    seen: list[int] = []
    hook = cv3_model.flow.decoder.estimator.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[2]))
    try:
        stream = token2wav_stream(cv3_model, voice, ChunkSchedule())
        work = []
        for start in range(0, tokens.shape[1], 50):
            for _chunk in stream.push(tokens[0, start : start + 50]):
                work.append((sum(seen) // 10, stream.hift_state.work_frames))
                seen.clear()
        return work
    finally:
        hook.remove()


def test_per_chunk_work_is_flat_over_30_seconds(cv3_model, voice):
    """750 tokens (30 s): after the growing first hops every chunk is 100 tokens, and both the flow and
    HiFT process exactly that chunk's 200 frames, the last chunk as the first (upstream re-runs both
    over everything so far: its chunk 8 would process 4x the frames of its chunk 2)."""
    tokens = torch.randint(0, 6561, (1, 750), generator=torch.Generator().manual_seed(3))
    work = _frames_per_chunk(cv3_model, voice, tokens)
    assert work[0] == (2 * (21 + 4 + 25), 2 * (4 + 25))  # the prompt's frames ride with chunk 0
    steady = work[2:]
    assert len(steady) >= 6 and all(w == (200, 200) for w in steady)
    assert sum(steady[-1]) / sum(steady[0]) <= 1.3
