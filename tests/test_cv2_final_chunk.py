"""`[schedule] final_chunk`: "reference" reproduces the official last streaming chunk (the whole utterance
recomputed with full attention), "chunk_mask" (the default) keeps the chunk masks; earlier chunks agree."""

from __future__ import annotations

import pytest
import torch
from cv2_engine_helpers import build_speaking_model_dir, load_speaking_model
from safetensors.torch import load_file
from torch.testing import assert_close

from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
from voicertc.backends.cosyvoice.serve.streams import token2wav_stream
from voicertc.backends.cosyvoice.voice.voices import voice_from_features
from voicertc.engine import ChunkSchedule

ATOL = 1e-4
SPEECH_TOL = {"rtol": 0.0, "atol": 1e-5}


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory) -> CosyVoice2Model:
    torch.set_num_threads(2)  # the golden tiny flow + HiFT, in a directory the loader accepts whole
    out = tmp_path_factory.mktemp("cv2_final_chunk")
    return load_speaking_model(build_speaking_model_dir(tiny_model_dir, golden_dir, out))


@pytest.fixture(scope="module")
def tts(golden_dir) -> dict[str, torch.Tensor]:
    return load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")


def _run(model, tts, final_chunk: str):
    voice = voice_from_features(model, tts["in_prompt_token"], tts["in_prompt_feat"], tts["in_embedding"])
    stream = token2wav_stream(
        model,
        voice,
        ChunkSchedule(final_chunk=final_chunk),  # type: ignore[arg-type]
        source_fn=lambda index: tts[f"stream_call{index}_hift_source"],
    )
    chunks = stream.push(tts["in_token"])
    return chunks + stream.finish()


def test_reference_final_chunk_is_the_official_last_call(model, tts):
    chunks = _run(model, tts, "reference")
    assert [c.mel.shape[2] for c in chunks] == [66, 100, 200, 34] and chunks[-1].final
    for k, chunk in enumerate(chunks):
        assert_close(chunk.mel, tts[f"stream_call{k}_flow_mel_after_offset_cut"], atol=ATOL, rtol=ATOL)
        assert_close(torch.from_numpy(chunk.pcm), tts[f"stream_call{k}_yield_speech"][0], **SPEECH_TOL)


def test_chunk_mask_final_chunk_differs_only_in_the_last_chunk(model, tts, golden_dir):
    ours, ref = _run(model, tts, "chunk_mask"), _run(model, tts, "reference")
    for a, b in zip(ours[:-1], ref[:-1], strict=True):
        assert_close(a.mel, b.mel, atol=0.0, rtol=0.0)
    chunkmask_mel = load_file(golden_dir / "flow_nonstream.safetensors")["chunkmask_mel"]
    assert_close(ours[-1].mel, chunkmask_mel[:, :, -34:], atol=ATOL, rtol=ATOL)
    assert (ours[-1].mel - ref[-1].mel).abs().max() > 1e-2  # the two last chunks really differ


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="final_chunk"):
        ChunkSchedule(final_chunk="full")  # type: ignore[arg-type]
