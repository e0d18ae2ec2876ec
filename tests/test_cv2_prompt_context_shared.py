"""Utterances on one voice read its prompt's flow context where it is (the captured path's packed
contexts): after their first chunk each holds the voice's frames as a read-only prefix (the same memory,
no copy) and owns only its own frames; what they speak equals an utterance whose context was copied."""

from __future__ import annotations

import torch
from cv2_engine_helpers import build_speaking_model_dir, load_speaking_model
from safetensors.torch import load_file
from torch.testing import assert_close

from voicertc.backends.cosyvoice.serve.backend import BackendOptions, CosyVoice2Backend
from voicertc.backends.cosyvoice.serve.streams import token2wav_stream
from voicertc.backends.cosyvoice.voice.voices import Voice, voice_from_features
from voicertc.engine import ChunkSchedule


def _long_voice(model, golden_dir) -> Voice:
    """A 3 s prompt (75 tokens: the golden 17 repeated): its first 50 tokens are encoded when the voice
    is prepared, so the voice holds 100 frames of flow context its utterances start from."""
    tts = load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")
    tokens = tts["in_prompt_token"].repeat(1, 5)[:, :75]
    feat = tts["in_prompt_feat"].repeat(1, 5, 1)[:, :150]
    return voice_from_features(model, tokens, feat, tts["in_embedding"], voice_id="long")


def _first_chunks(model, voice, streams: int, schedule: ChunkSchedule):
    first = schedule.first_hop_tokens + schedule.lookahead_tokens
    t2ws = [
        token2wav_stream(model, voice, schedule, generator=torch.Generator().manual_seed(i))
        for i in range(streams)
    ]  # seeded excitation: the two runs below draw the same noise
    gen = torch.Generator().manual_seed(3)
    pcm = [
        t2w.push(torch.randint(0, model.flow.cfg.vocab_size, (first,), generator=gen).tolist())[0].pcm
        for t2w in t2ws
    ]
    return t2ws, pcm


def test_utterances_read_the_voice_prompt_in_place(tiny_model_dir, golden_dir, tmp_path):
    torch.set_num_threads(2)
    model = load_speaking_model(build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path))
    schedule = ChunkSchedule()
    backend = CosyVoice2Backend(
        model, schedule, options=BackendOptions(seed=5, static_steps=True, graph_rows=4)
    )
    try:
        voice = _long_voice(model, golden_dir)  # prepared through the static steps: its context is packed
        voice_caches = [c.packed for c in voice.flow_state.estimator]
        assert all(p is not None for p in voice_caches)
        prompt_frames = voice.flow_state.frames
        t2ws, shared_pcm = _first_chunks(model, voice, 3, schedule)
        for t2w in t2ws:
            for step, cache in enumerate(t2w.flow_state.estimator):
                packed, voice_packed = cache.packed, voice_caches[step]
                assert packed is not None and voice_packed is not None
                assert packed.prefix is not None and packed.prefix_frames == prompt_frames
                assert packed.prefix.data_ptr() == voice_packed.kv.data_ptr()  # not a copy
                assert packed.own_frames == packed.frames - prompt_frames > 0
            assert t2w.flow_state.cache_bytes() < voice.flow_state.cache_bytes() + 10**9  # sanity
        # the same first chunks from a context copied into each utterance (the voice prepared eagerly)
        backend.close()
        copied_voice = _long_voice(model, golden_dir)
        _, copied_pcm = _first_chunks(model, copied_voice, 3, schedule)
        for a, b in zip(shared_pcm, copied_pcm, strict=True):
            assert_close(torch.as_tensor(a), torch.as_tensor(b), atol=2e-3, rtol=0)
        for t2w in t2ws:
            t2w.release()
    finally:
        backend.close()
