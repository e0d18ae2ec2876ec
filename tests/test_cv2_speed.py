"""speed: non-streaming only, as the reference (cosyvoice.md §6.2): the segment's tokens become one chunk,
the full-attention mel is linearly interpolated to len/speed frames, then vocoded."""

from __future__ import annotations

import pytest
import torch
from cv2_engine_helpers import (
    GOLDEN_VOICE,
    build_speaking_model_dir,
    golden_voice,
    load_speaking_model,
    make_backend,
)
from engine_helpers import EventLog, RecordingSink
from safetensors.torch import load_file

from voicertc.backends.cosyvoice.serve.streams import token2wav_stream
from voicertc.engine import Cancelled, ChunkSchedule, Done, FirstAudio
from voicertc.engine.protocol import SpeakOptions
from voicertc.engine.worker import EngineWorker

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory):
    return load_speaking_model(
        build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("m"))
    )


@pytest.mark.parametrize("speed", [2.0, 0.75])
def test_a_speed_change_is_one_retimed_full_attention_chunk(model, golden_dir, speed):
    tts = load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")
    voice = golden_voice(model, golden_dir)
    tokens = tts["in_token"]  # [1, N]
    stream = token2wav_stream(
        model, voice, ChunkSchedule(), generator=torch.Generator().manual_seed(0), speed=speed
    )
    assert stream.push(tokens) == []  # no chunk before the end: not streaming
    chunks = stream.finish()
    assert len(chunks) == 1 and chunks[0].final
    full = model.flow.infer(
        tokens, voice.flow_prompt_tokens, voice.prompt_feat, voice.embedding, streaming=False, finalize=True
    )  # the reference's non-stream token2wav mel: [1, 80, 2N]
    expected = torch.nn.functional.interpolate(full, size=int(full.shape[2] / speed), mode="linear")
    torch.testing.assert_close(chunks[0].mel, expected)
    assert len(chunks[0].pcm) == expected.shape[2] * 480


def _audio_ms(model, golden_dir, speed: float) -> float:
    backend = make_backend(model, golden_dir, max_segment_tokens=40)
    engine = EngineWorker(backend, name="cv2-speed")
    engine.start()
    try:
        log = EventLog()
        uid = engine.open_utterance(GOLDEN_VOICE, RecordingSink(), log, "same-id", SpeakOptions(speed=speed))
        engine.push_text(uid, "Hello there, this is a test.", end=True)
        log.wait_terminal([uid], 120)
        done = log.of(uid)[-1]
        assert isinstance(done, Done), done
        return done.audio_ms
    finally:
        engine.stop()


def test_the_engine_speaks_faster_and_slower(model, golden_dir):
    normal = _audio_ms(model, golden_dir, 1.0)  # same utterance id and seed: the same speech tokens
    fast = _audio_ms(model, golden_dir, 2.0)
    slow = _audio_ms(model, golden_dir, 0.8)
    assert normal > 1000
    assert fast == pytest.approx(normal / 2.0, abs=45.0)
    assert slow == pytest.approx(normal / 0.8, abs=45.0)


def test_a_long_speed_segment_runs_in_bounded_full_attention_windows(model, golden_dir, monkeypatch):
    tts = load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")
    voice = golden_voice(model, golden_dir)
    tokens = tts["in_token"][:, :50]  # [1, 50]: windows of 20, 20, 10
    window, speed = 20, 0.8
    calls: list[int] = []
    infer, start_window = model.flow.infer, model.flow.start_window

    def counting(speech_tokens, *args, **kwargs):
        calls.append(speech_tokens.shape[1])
        return start_window(speech_tokens, *args, **kwargs)

    monkeypatch.setattr(model.flow, "start_window", counting)
    stream = token2wav_stream(
        model, voice, ChunkSchedule(), generator=torch.Generator().manual_seed(0), speed=speed,
        speed_window_tokens=window,
    )  # fmt: skip
    chunks = stream.push(tokens) + stream.finish()
    n = tokens.shape[1]
    assert n > 2 * window and len(chunks) == -(-n // window)
    assert calls and max(calls) <= window and sum(calls) == n  # every flow call bounded, each token once
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    first = infer(
        tokens[:, :window], voice.flow_prompt_tokens, voice.prompt_feat, voice.embedding,
        streaming=False, finalize=True,
    )  # fmt: skip
    expected = torch.nn.functional.interpolate(first, size=int(first.shape[2] / speed), mode="linear")
    torch.testing.assert_close(chunks[0].mel, expected)
    frames = sum(c.mel.shape[2] for c in chunks)
    assert sum(len(c.pcm) for c in chunks) == frames * 480


def test_a_cancel_lands_between_speed_windows_and_frees_the_utterance(model, golden_dir):
    backend = make_backend(model, golden_dir, max_segment_tokens=400, speed_window_tokens=20)
    engine = EngineWorker(backend, name="cv2-speed-cancel")
    engine.start()
    try:
        log = EventLog()
        uid = engine.open_utterance(GOLDEN_VOICE, RecordingSink(), log, "u-cancel", SpeakOptions(speed=0.8))
        engine.push_text(
            uid, "A long sentence to say slowly, one window at a time, until it is cut. " * 3, end=True
        )
        log.wait_for(uid, FirstAudio, timeout_s=120)  # the first window is out: the segment is not one call
        engine.cancel(uid)
        log.wait_terminal([uid], 60)
        assert isinstance(log.of(uid)[-1], Cancelled)
        assert backend._active == {} and engine.open_count == 0
    finally:
        engine.stop()


def test_the_llm_stops_at_the_segment_token_budget(model, golden_dir):
    backend = make_backend(model, golden_dir, max_segment_tokens=30)
    engine = EngineWorker(backend, name="cv2-budget")
    engine.start()
    try:
        log, sink = EventLog(), RecordingSink()
        uid = engine.open_utterance(GOLDEN_VOICE, sink, log, "u-budget")
        engine.push_text(
            uid, "This sentence would need far more than thirty speech tokens to be said.", end=True
        )
        log.wait_terminal([uid], 120)
        done = log.of(uid)[-1]
        assert isinstance(done, Done), done
        assert done.audio_ms == pytest.approx(30 * 40.0, abs=1.0)  # 30 tokens x 40 ms
    finally:
        engine.stop()
