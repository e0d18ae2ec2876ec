"""Token2WavStream: the official streaming chunks from pushed tokens, streaming == offline, per-utterance
schedule state, and release frees every cache."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from voicertc.backends.cosyvoice.load import load_v2 as load
from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
from voicertc.backends.cosyvoice.serve.streams import token2wav_stream
from voicertc.backends.cosyvoice.serve.token2wav import Token2WavStream
from voicertc.backends.cosyvoice.voice.voices import voice_from_features
from voicertc.engine import ChunkSchedule

ATOL = 1e-4
SPEECH_TOL = {"rtol": 0.0, "atol": 1e-5}


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> CosyVoice2Model:
    return load(tiny_model_dir, check_frontend=False)  # the golden directory has no frontend files


@pytest.fixture(scope="module")
def tts(golden_dir) -> dict[str, torch.Tensor]:
    return load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")


@pytest.fixture(scope="module")
def chunkmask_mel(golden_dir) -> torch.Tensor:
    return load_file(golden_dir / "flow_nonstream.safetensors")["chunkmask_mel"]


@pytest.fixture(scope="module")
def voice(model, tts):
    return voice_from_features(model, tts["in_prompt_token"], tts["in_prompt_feat"], tts["in_embedding"])


def _golden_source(tts):
    return lambda index: tts[f"stream_call{index}_hift_source"]


def _all_chunks(stream: Token2WavStream, tokens: torch.Tensor, step: int):
    chunks = []
    for start in range(0, tokens.shape[1], step):
        chunks += stream.push(tokens[0, start : start + step])
    return chunks + stream.finish()


def test_pushing_all_tokens_gives_the_official_streaming_chunks(model, voice, tts, chunkmask_mel):
    stream = token2wav_stream(model, voice, ChunkSchedule(), source_fn=_golden_source(tts))
    chunks = stream.push(tts["in_token"])
    assert [c.mel.shape[2] for c in chunks] == [66, 100, 200]
    for k, chunk in enumerate(chunks):
        assert_close(chunk.mel, tts[f"stream_call{k}_flow_mel_after_offset_cut"], atol=ATOL, rtol=ATOL)
        assert chunk.pcm.dtype == "float32" and not chunk.final
        assert_close(torch.from_numpy(chunk.pcm), tts[f"stream_call{k}_yield_speech"][0], **SPEECH_TOL)
    final = stream.finish()
    assert len(final) == 1 and final[0].final and final[0].mel.shape[2] == 34
    # the final chunk keeps the chunk masks: the whole mel is the chunk-masked whole-utterance mel
    assert_close(torch.cat([c.mel for c in chunks + final], dim=2), chunkmask_mel, atol=ATOL, rtol=ATOL)
    assert sum(len(c.pcm) for c in chunks + final) == 480 * 400  # held-back 160 ms flushed at the end


def test_a_short_first_hop_on_the_grid_gives_the_same_mel_sooner(model, voice, tts, chunkmask_mel):
    """first_hop_tokens=5 on the 25-token grid: the 17-token prompt's first chunk ends at token 25, so it
    needs 8 + 3 tokens instead of the reference's 33 + 3; the whole mel is still the golden one."""
    schedule = ChunkSchedule(first_hop_tokens=5, grid_tokens=25)
    stream = token2wav_stream(model, voice, schedule)
    tokens = tts["in_token"][0].tolist()
    assert stream.push(tokens[:10]) == []
    first = stream.push(tokens[10:11])
    assert len(first) == 1 and first[0].mel.shape[2] == 16
    chunks = first + stream.push(tokens[11:]) + stream.finish()
    assert [c.mel.shape[2] for c in chunks] == [16, 100, 200, 84]
    assert_close(torch.cat([c.mel for c in chunks], dim=2), chunkmask_mel, atol=ATOL, rtol=ATOL)


@pytest.fixture(scope="module")
def whole(model, voice, tts):
    return _all_chunks(token2wav_stream(model, voice, source_fn=_golden_source(tts)), tts["in_token"], 200)


@pytest.mark.parametrize("step", [1, 7])
def test_token_by_token_gives_the_same_chunks(model, voice, tts, whole, step):
    pieces = _all_chunks(token2wav_stream(model, voice, source_fn=_golden_source(tts)), tts["in_token"], step)
    assert [c.mel.shape[2] for c in pieces] == [c.mel.shape[2] for c in whole]
    for a, b in zip(pieces, whole, strict=True):
        assert_close(a.mel, b.mel, atol=1e-5, rtol=0.0)
        assert_close(torch.from_numpy(a.pcm), torch.from_numpy(b.pcm), atol=1e-5, rtol=0.0)


def test_a_chunk_runs_exactly_when_its_lookahead_arrives(model, voice, tts):
    stream = token2wav_stream(model, voice)
    tokens = tts["in_token"][0].tolist()
    assert stream.push(tokens[:35]) == []  # first chunk: 8 pad + 25 hop + 3 lookahead = 36
    first = stream.push(tokens[35:36])
    assert len(first) == 1 and first[0].mel.shape[2] == 66
    assert stream.push(tokens[36:85]) == []  # second: 50 more tokens + 3 lookahead = 86
    assert len(stream.push(tokens[85:86])) == 1


def test_every_stream_starts_with_the_first_hop(model, voice, tts):
    """The schedule is pure: 100 sequential streams all emit a 66-frame first chunk (no shared hop)."""
    schedule = ChunkSchedule()
    tokens = tts["in_token"][0, :36].tolist()
    for _ in range(100):
        stream = token2wav_stream(model, voice, schedule)
        stream.add_tokens(tokens)
        plan = stream.plan()
        assert plan is not None and plan.new_tokens.shape[1] == 36 and plan.end_tokens == 33
        stream.release()
    stream = token2wav_stream(model, voice, schedule)
    assert [c.mel.shape[2] for c in stream.push(tokens)] == [66]


def test_release_frees_every_cache(model, voice, tts):
    stream = token2wav_stream(model, voice)
    stream.push(tts["in_token"][0, :100])
    assert stream.flow_state is not None and stream.flow_state.cache_bytes() > 0
    assert stream.hift_state is not None and stream.hift_state.mel_cache is not None
    stream.release()
    assert stream.flow_state is None and stream.hift_state is None and stream.tokens == []
    assert stream.plan(final=True) is None
    with pytest.raises(ValueError, match="released"):
        stream.push([1, 2, 3])
    # the voice's cached prompt state is untouched
    again = token2wav_stream(model, voice)
    assert len(again.push(tts["in_token"][0, :36])) == 1


def test_finish_releases_and_empty_streams_emit_nothing(model, voice, tts):
    stream = token2wav_stream(model, voice)
    chunks = stream.push(tts["in_token"][0, :50]) + stream.finish()
    assert chunks[-1].final and stream.flow_state is None and stream.hift_state is None
    assert sum(c.mel.shape[2] for c in chunks) == 100
    assert token2wav_stream(model, voice).finish() == []


def test_short_utterance_is_one_final_chunk(model, voice, tts):
    stream = token2wav_stream(model, voice, generator=torch.Generator().manual_seed(0))
    chunks = stream.push(tts["in_token"][0, :10]) + stream.finish()
    assert len(chunks) == 1 and chunks[0].final
    assert chunks[0].mel.shape[2] == 20 and len(chunks[0].pcm) == 20 * 480


def test_schedule_off_the_flow_grid_is_rejected(model, voice):
    with pytest.raises(ValueError, match="multiples"):
        token2wav_stream(model, voice, ChunkSchedule(first_hop_tokens=10, max_hop_tokens=40))
    with pytest.raises(ValueError, match="lookahead"):
        token2wav_stream(model, voice, ChunkSchedule(lookahead_tokens=2))
