"""speed != 1 on CosyVoice2 in bounded engine steps (issue 24, item 1).

A speed window is one full-attention flow call (the reference's non-stream token2wav) over up to
`speed_window_tokens`: solved one Euler step per engine step, and its re-timed mel vocoded in pieces no
longer than a streaming chunk's, so another call's unit and a cancel land between them.
"""

from __future__ import annotations

import numpy as np
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
from parts_helpers import one_second_clock
from safetensors.torch import load_file

from voicertc.engine import Cancelled, Done
from voicertc.engine.protocol import SpeakOptions
from voicertc.engine.work import FlowChunk, Vocode
from voicertc.engine.worker import EngineWorker

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory):
    return load_speaking_model(
        build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("m"))
    )


def test_a_full_attention_call_solved_step_by_step_equals_the_call_made_at_once(model, golden_dir):
    tokens = load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")["in_token"]
    voice = golden_voice(model, golden_dir)
    prompt = (voice.flow_prompt_tokens, voice.prompt_feat, voice.embedding)
    at_once = model.flow.infer(tokens, *prompt, streaming=False, finalize=True)
    window = model.flow.start_window(tokens, *prompt, streaming=False, finalize=True)
    calls: list[int] = []
    hook = model.flow.decoder.estimator.register_forward_hook(lambda *_: calls.append(1))
    try:
        mels = [model.flow.advance_window(window, euler_steps=1) for _ in range(model.flow.cfg.n_timesteps)]
    finally:
        hook.remove()
    assert all(m is None for m in mels[:-1]) and mels[-1] is not None
    assert len(calls) == model.flow.cfg.n_timesteps  # one estimator forward (the CFG pair) per part
    assert torch.equal(mels[-1], at_once)
    assert model.flow.advance_window(window, euler_steps=1) is mels[-1]  # solved: nothing more runs


def test_a_full_attention_call_solved_in_estimator_parts_equals_the_call_made_at_once(model, golden_dir):
    """Under `[engine] max_step_ms` a window's Euler steps go one estimator stage per part."""
    tokens = load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")["in_token"]
    voice = golden_voice(model, golden_dir)
    prompt = (voice.flow_prompt_tokens, voice.prompt_feat, voice.embedding)
    at_once = model.flow.infer(tokens, *prompt, streaming=False, finalize=True)
    window = model.flow.start_window(tokens, *prompt, streaming=False, finalize=True)
    per_step = model.flow.decoder.estimator.n_stages + 1
    mels = [model.flow.advance_window(window, parts=1) for _ in range(model.flow.cfg.n_timesteps * per_step)]
    assert all(m is None for m in mels[:-1]) and mels[-1] is not None
    assert torch.equal(mels[-1], at_once)
    with pytest.raises(ValueError, match="not both"):
        model.flow.advance_window(
            model.flow.start_window(tokens, *prompt, streaming=False, finalize=True), 1, parts=1
        )


class StepRecorder:
    """Wraps the backend's `run`: per engine step, its unit, the estimator forwards and HiFT input frames."""

    def __init__(self, backend, model, monkeypatch) -> None:
        self.steps: list[tuple[str, int, int]] = []  # (unit, estimator forwards, HiFT input frames)
        self.on_step = None
        self._estimator, self._frames = 0, 0
        hook = model.flow.decoder.estimator.register_forward_hook(self._count_estimator)
        self.remove = hook.remove
        decode, run = model.hift.decode, backend.run

        def counted_decode(mel, source):
            self._frames = max(self._frames, mel.shape[2])
            return decode(mel, source)

        def recorded(batch, now_s):
            self._estimator, self._frames = 0, 0
            results = run(batch, now_s)
            self.steps.append((type(batch[0].work).__name__, self._estimator, self._frames))
            if self.on_step is not None:
                self.on_step(batch[0].work)
            return results

        monkeypatch.setattr(model.hift, "decode", counted_decode)
        monkeypatch.setattr(backend, "run", recorded)

    def _count_estimator(self, *_):
        self._estimator += 1


@pytest.fixture
def recording(model, monkeypatch):
    recorders: list[StepRecorder] = []

    def record(backend) -> StepRecorder:
        recorders.append(StepRecorder(backend, model, monkeypatch))
        return recorders[-1]

    yield record
    for recorder in recorders:
        recorder.remove()


def test_every_engine_step_of_a_speed_utterance_is_bounded(model, golden_dir, recording):
    window_tokens, speed = 120, 0.5
    backend = make_backend(model, golden_dir, max_segment_tokens=300, speed_window_tokens=window_tokens)
    recorder = recording(backend)
    engine = EngineWorker(backend, name="cv2-speed-steps")
    engine.start()
    try:
        log, sink = EventLog(), RecordingSink()
        uid = engine.open_utterance(GOLDEN_VOICE, sink, log, "u-steps", SpeakOptions(speed=speed))
        engine.push_text(
            uid, "A long sentence said slowly, in bounded steps, window after window. " * 4, end=True
        )
        log.wait_terminal([uid], 300)
        done = log.of(uid)[-1]
        assert isinstance(done, Done), done
    finally:
        engine.stop()
    flows = [s for s in recorder.steps if s[0] == FlowChunk.__name__]
    vocodes = [s for s in recorder.steps if s[0] == Vocode.__name__]
    steps = model.flow.cfg.n_timesteps
    assert flows and max(n for _, n, _ in flows) == 1  # one Euler step of a window per engine step
    windows = -(-int(done.audio_ms * speed / 40.0 + 0.5) // window_tokens)  # tokens spoken, per window
    assert len(flows) == windows * steps
    piece = backend.vocoder_piece_frames
    assert max(f for _, _, f in vocodes) <= piece + 8  # a piece plus HiFT's carried mel frames
    window_frames = 2 * window_tokens / speed
    assert window_frames > 2 * piece and len(vocodes) >= windows + 2  # the long windows went in pieces
    audio = sum(len(p) for p in sink.pcm[uid])
    assert audio == pytest.approx(done.audio_ms * 24, abs=1)


def test_a_cancel_lands_inside_a_window_between_its_euler_steps(model, golden_dir, recording):
    backend = make_backend(model, golden_dir, max_segment_tokens=300, speed_window_tokens=120)
    recorder = recording(backend)
    engine = EngineWorker(backend, name="cv2-speed-cancel-steps")
    engine.start()
    try:
        log = EventLog()
        uid = engine.open_utterance(GOLDEN_VOICE, RecordingSink(), log, "u-cut", SpeakOptions(speed=0.5))
        flows: list[object] = []

        def cancel_at_third_flow_step(work):
            if isinstance(work, FlowChunk):
                flows.append(work)
                if len(flows) == 3:
                    engine.cancel(uid)

        recorder.on_step = cancel_at_third_flow_step
        engine.push_text(
            uid, "A long sentence said slowly, in bounded steps, window after window. " * 4, end=True
        )
        log.wait_terminal([uid], 300)
        assert isinstance(log.of(uid)[-1], Cancelled)
        assert len(flows) == 3  # cancelled mid-window: none of its other seven Euler steps ran
        assert backend._active == {} and engine.open_count == 0
    finally:
        engine.stop()


def test_under_a_step_budget_a_window_goes_one_estimator_stage_per_unit_and_speaks_the_same(
    model, golden_dir, monkeypatch
):
    """`max_step_ms` with a clock that makes every part look like a second: one part per unit."""
    text = "Said slowly, in bounded parts. " * 2
    audio = {}
    parts: list[int] = []
    original = model.flow.decoder.advance_part

    def counted(solve):
        parts.append(1)
        return original(solve)

    monkeypatch.setattr(model.flow.decoder, "advance_part", counted)
    for name, extra in (
        ("whole", {}),
        ("parts", {"max_step_ms": 1500, "step_clock": one_second_clock()}),
    ):
        backend = make_backend(model, golden_dir, max_segment_tokens=200, speed_window_tokens=60, **extra)
        units: list[int] = []
        run = backend.run

        def recorded(batch, now_s, run=run, units=units):
            before = len(parts)
            results = run(batch, now_s)
            if isinstance(batch[0].work, FlowChunk):
                units.append(len(parts) - before)
            return results

        backend.run = recorded
        engine = EngineWorker(backend, name=f"cv2-speed-{name}")
        engine.start()
        try:
            log, sink = EventLog(), RecordingSink()
            uid = engine.open_utterance(GOLDEN_VOICE, sink, log, "u", SpeakOptions(speed=0.8))
            engine.push_text(uid, text, end=True)
            log.wait_terminal([uid], 300)
            assert isinstance(log.of(uid)[-1], Done)
        finally:
            engine.stop()
        audio[name] = sink.samples(uid)
        if name == "parts":
            per_window = model.flow.cfg.n_timesteps * (model.flow.decoder.estimator.n_stages + 1)
            assert units and max(units) == 1 and len(units) % per_window == 0
        else:
            assert not parts  # no budget: whole Euler steps
    assert audio["parts"].size == audio["whole"].size > 0
    assert np.array_equal(audio["parts"], audio["whole"])
