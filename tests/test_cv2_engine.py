"""The cosyvoice2 backend behind the real EngineWorker on the tiny model: audio and one Done with metrics,
cancel and failure free every cache (others keep streaming), batched == unbatched, text-in streaming
speaks before the text ends, and voice registration errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import soundfile
import torch
from cv2_engine_helpers import (
    GOLDEN_VOICE,
    SFT_VOICE,
    build_speaking_model_dir,
    load_speaking_model,
    make_backend,
)
from engine_helpers import EventLog, RecordingSink

from voicertc.backends.cosyvoice.accel.tape import no_host_syncs
from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
from voicertc.backends.cosyvoice.serve.backend import CosyVoice2Backend
from voicertc.engine import Cancelled, ChunkSchedule, Done, Failed, FirstAudio
from voicertc.engine.worker import EngineWorker
from voicertc.errors import InputError, UnknownVoiceError

LONG_TEXT = "Zebras quietly jump over seven lazy dogs near Mount Vesuvius today."  # 61 tiny-BPE tokens
TOKEN_SAMPLES = 960  # 2 mel frames x 480 samples per speech token


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory) -> CosyVoice2Model:
    model_dir = build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("cv2_speak"))
    return load_speaking_model(model_dir)


def _run(
    backend: CosyVoice2Backend,
    jobs: list[tuple[str, str, str]],
    default_voice: str = GOLDEN_VOICE,
    engine: EngineWorker | None = None,
):
    """Say each (utterance id, voice, text) on its own sink; wait for every terminal event."""
    engine = engine or EngineWorker(backend, default_voice=default_voice)
    log, sinks = EventLog(), {}
    engine.start()
    try:
        for uid, voice, text in jobs:
            sinks[uid] = RecordingSink()
            engine.open_utterance(voice, sinks[uid], log, utterance_id=uid)
            engine.push_text(uid, text, end=True)
        log.wait_terminal([uid for uid, _, _ in jobs], timeout_s=300)
    finally:
        engine.stop()
    return log, sinks


def _without_host_syncs(unit):
    """A backend unit run under `accel.tape.no_host_syncs` (a sync fails the utterance, then the test)."""

    def guarded(self, *args, **kwargs):
        with no_host_syncs():
            return unit(self, *args, **kwargs)

    return guarded


def _track_streams(model, monkeypatch) -> list:
    """Every token2wav stream the backend opens on `model`."""
    from voicertc.backends.cosyvoice.serve import backend as backend_module
    from voicertc.backends.cosyvoice.serve.streams import token2wav_stream

    streams = []

    def recording(on_model, *args, **kwargs):
        stream = token2wav_stream(on_model, *args, **kwargs)
        if on_model is model:
            streams.append(stream)
        return stream

    monkeypatch.setattr(backend_module, "token2wav_stream", recording)
    return streams


def test_utterance_speaks_with_one_done_and_stage_metrics(model, golden_dir, monkeypatch):
    streams = _track_streams(model, monkeypatch)
    backend = make_backend(model, golden_dir, max_segment_tokens=60)
    log, sinks = _run(backend, [("u1", GOLDEN_VOICE, LONG_TEXT)])
    events = log.of("u1")
    assert [type(e) for e in events] == [FirstAudio, Done]
    done = events[-1]
    pcm = sinks["u1"].samples("u1")
    assert sinks["u1"].rates == {24000} and np.isfinite(pcm).all() and np.abs(pcm).max() > 1e-3
    assert len(pcm) == 60 * TOKEN_SAMPLES  # 61 text tokens: eos is banned below 122, so the 60-token cap
    assert done.audio_ms == pytest.approx(1000 * len(pcm) / 24000)
    for key in ("frontend_s", "llm_prefill_s", "llm_decode_s", "decode_first_hop_s", "flow_s", "vocoder_s"):
        assert done.metrics[key] > 0, key
    assert {"ttfa_s", "rtf", "queue_wait_s"} <= set(done.metrics)
    assert len(streams) == 1 and streams[0].flow_state is None and streams[0].hift_state is None
    assert backend._active == {}


def test_text_without_tokens_is_done_without_audio(model, golden_dir):
    log, sinks = _run(make_backend(model, golden_dir), [("u1", GOLDEN_VOICE, "... !?")])
    events = log.of("u1")
    assert [type(e) for e in events] == [Done] and events[0].audio_ms == 0.0
    assert sinks["u1"].samples("u1").size == 0


def test_cancel_frees_every_cache(model, golden_dir, monkeypatch):
    streams = _track_streams(model, monkeypatch)
    backend = make_backend(model, golden_dir, max_segment_tokens=400)
    engine = EngineWorker(backend, default_voice=GOLDEN_VOICE)
    log, sink, first = EventLog(), RecordingSink(), threading.Event()
    engine.start()
    try:

        def on_event(event):
            log(event)
            if isinstance(event, FirstAudio):
                first.set()

        uid = engine.say(None, sink, on_event, LONG_TEXT)
        assert first.wait(120)
        engine.cancel(uid)
        log.wait_terminal([uid])
    finally:
        engine.stop()
    assert isinstance(log.of(uid)[-1], Cancelled)
    assert backend._active == {}
    assert streams and all(s.flow_state is None and s.hift_state is None and s.tokens == [] for s in streams)


@pytest.mark.expected_errors("injected flow failure")
def test_flow_failure_fails_only_its_utterance(model, golden_dir, monkeypatch):
    """The golden voice's flow steps raise; the sft voice's utterance streams on to the end."""
    original = model.flow.start_stream_batch

    def faulty(new_tokens, states, finalize):
        if any(s.prompt_feat.shape[1] == 34 for s in states):
            raise RuntimeError("injected flow failure")
        return original(new_tokens, states, finalize)

    monkeypatch.setattr(model.flow, "start_stream_batch", faulty)
    streams = _track_streams(model, monkeypatch)
    backend = make_backend(model, golden_dir, max_segment_tokens=60)
    log, sinks = _run(backend, [("bad", GOLDEN_VOICE, LONG_TEXT), ("good", SFT_VOICE, LONG_TEXT)])
    bad, good = log.of("bad")[-1], log.of("good")[-1]
    assert isinstance(bad, Failed) and "injected flow failure" in bad.message
    assert isinstance(good, Done) and good.audio_ms == pytest.approx(60 * 40.0)
    assert sinks["good"].samples("good").size == 60 * TOKEN_SAMPLES
    assert all(s.flow_state is None and s.hift_state is None for s in streams)
    assert backend._active == {}


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def test_batched_equals_unbatched(model, golden_dir):
    jobs = [("a", GOLDEN_VOICE, LONG_TEXT), ("b", GOLDEN_VOICE, LONG_TEXT), ("c", SFT_VOICE, LONG_TEXT)]
    batched = make_backend(model, golden_dir, max_segment_tokens=100, flow_batch_rows=3)
    single = make_backend(model, golden_dir, max_segment_tokens=100, flow_batch_rows=1)
    _, sinks_b = _run(batched, jobs)
    _, sinks_s = _run(single, jobs)
    assert batched.stats["batched_chunks"] >= 2 and single.stats["batched_chunks"] == 0
    for uid, _, _ in jobs:
        a, b = sinks_b[uid].samples(uid), sinks_s[uid].samples(uid)
        assert a.size == 100 * TOKEN_SAMPLES
        # the estimator batch changes float32 rounding (mel ~1e-6); HiFT's f0 head (gain ~400) turns
        # that into sample differences of a few 1e-4: the difference stays 50 dB below the signal
        np.testing.assert_allclose(a, b, atol=2e-3, rtol=0)
        assert _rms(a - b) < 3e-3 * _rms(a)
    assert not np.allclose(sinks_b["a"].samples("a"), sinks_b["b"].samples("b"))  # own RNG per utterance


def test_static_shape_flow_and_vocoder_steps_speak_as_eager(model, golden_dir, monkeypatch):
    """The path `[engine] cuda_graphs` captures on CUDA, recorded and replayed on CPU (`accel.tape`): same
    audio as eager, and its flow and vocoder units only queue work (no op that syncs the host)."""
    jobs = [("a", GOLDEN_VOICE, LONG_TEXT), ("b", GOLDEN_VOICE, LONG_TEXT), ("c", SFT_VOICE, LONG_TEXT)]
    units = ("_run_flow", "_continue_flow", "_run_vocode", "_continue_vocode")
    for name in units:
        monkeypatch.setattr(CosyVoice2Backend, name, _without_host_syncs(getattr(CosyVoice2Backend, name)))
    static = make_backend(model, golden_dir, max_segment_tokens=100, static_steps=True, graph_rows=4)
    captured = static.captured
    assert captured is not None and model.flow.decoder.estimator_runner is captured.flow
    assert model.flow.encoder_runner is captured.encoder is not None
    counts_before = static.captured_counts()
    _, sinks_static = _run(static, jobs)  # _run closes the backend: the runners come off the model
    assert counts_before["flow"]["replays"] == 0 and set(counts_before) == {"flow", "flow_encoder", "vocoder"}
    assert model.flow.decoder.estimator_runner is None and model.hift.decode_runner is None
    assert model.flow.encoder_runner is None
    monkeypatch.undo()
    _, sinks_eager = _run(make_backend(model, golden_dir, max_segment_tokens=100), jobs)
    stats = captured.stats()
    assert stats["flow"].replays > 0 and stats["vocoder"].replays > 0
    assert stats["flow_encoder"].replays > 0 and stats["flow_encoder"].eager == 0
    assert static.captured_counts() == {}  # closed: the stages came off the model (/metrics: none)
    assert {key[0] for key in stats["flow"].by_shape} <= {2, 4, 8}  # 2 CFG rows per utterance, padded
    for uid, _, _ in jobs:
        a, b = sinks_static[uid].samples(uid), sinks_eager[uid].samples(uid)
        assert a.size == b.size == 100 * TOKEN_SAMPLES
        np.testing.assert_allclose(a, b, atol=2e-3, rtol=0)  # row padding: float32 rounding, as batching
        assert _rms(a - b) < 3e-3 * _rms(a)


def test_decoding_ahead_speaks_what_step_by_step_decoding_speaks(model, golden_dir):
    """The decode graphs' path (`static_decode`: recorded and replayed on CPU, `accel.tape`): three
    utterances at once, each step launched before the one before is read (`llm.ahead`) or read at once:
    the same tokens, so the same audio, sample for sample; /metrics counts the steps launched ahead."""
    jobs = [("a", GOLDEN_VOICE, LONG_TEXT), ("b", GOLDEN_VOICE, LONG_TEXT), ("c", SFT_VOICE, LONG_TEXT)]
    ahead = make_backend(model, golden_dir, max_segment_tokens=40, static_decode=True, graph_rows=4)
    stepped = make_backend(
        model, golden_dir, max_segment_tokens=40, static_decode=True, graph_rows=4, decode_ahead=False
    )
    assert ahead.graphs is not None and ahead.graphs.cpu_capture is not None
    engines = [EngineWorker(backend, default_voice=GOLDEN_VOICE) for backend in (ahead, stepped)]
    _, sinks_ahead = _run(ahead, jobs, engine=engines[0])
    _, sinks_stepped = _run(stepped, jobs, engine=engines[1])
    assert ahead.stats["decode_ahead"] >= 6 and stepped.stats["decode_ahead"] == 0
    assert ahead.stats["decode_rows"] == stepped.stats["decode_rows"]  # no step taken or counted twice
    counted = [e.batch_stats.captured["decode"]["launched_ahead"] for e in engines]  # as /metrics reads
    assert counted == [ahead.stats["decode_ahead"], 0]
    for uid, _, _ in jobs:
        a, b = sinks_ahead[uid].samples(uid), sinks_stepped[uid].samples(uid)
        assert a.size == b.size == 40 * TOKEN_SAMPLES
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(sinks_ahead["a"].samples("a"), sinks_ahead["b"].samples("b"))


def test_first_audio_arrives_before_the_text_stream_ends(model, golden_dir):
    backend = make_backend(model, golden_dir, max_segment_tokens=120)
    engine = EngineWorker(backend, default_voice=SFT_VOICE)
    log, sink, first = EventLog(), RecordingSink(), threading.Event()
    engine.start()
    try:

        def on_event(event):
            log(event)
            if isinstance(event, FirstAudio):
                first.set()

        uid = engine.open_utterance(None, sink, on_event)
        for word in (LONG_TEXT + " And").split(" "):
            engine.push_text(uid, word + " ")
        assert first.wait(120), "no audio before the end of the text stream"
        assert backend._active[uid].backend_state.mode == "deltas"
        engine.push_text(uid, "then it ends.", end=True)
        log.wait_terminal([uid], timeout_s=300)
    finally:
        engine.stop()
    assert [type(e) for e in log.of(uid)] == [FirstAudio, Done]
    assert sink.samples(uid).size > 28 * TOKEN_SAMPLES


def _wav(path, seconds: float, rate_hz: int = 44100, channels: int = 2):
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    tone = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    soundfile.write(str(path), np.stack([tone] * channels, axis=1).astype(np.float32), rate_hz)
    return path


def test_voice_registration_persists_and_bad_prompts_are_refused(model, golden_dir, tmp_path):
    voices_dir = tmp_path / "voices"
    backend = make_backend(model, golden_dir, voices_dir=voices_dir)
    before = backend.voices()
    (tmp_path / "notes.wav").write_text("not audio")
    bad = [
        (tmp_path / "notes.wav", "hello", "cannot be decoded"),
        (_wav(tmp_path / "short.wav", 0.5), "hello", "at least 1 s"),
        (_wav(tmp_path / "long.wav", 31.0, 16000, 1), "hello", "the limit is 30 s"),
        (tmp_path / "missing.wav", "hello", "cannot read"),
    ]
    _wav(tmp_path / "ok.wav", 2.0)
    for path, transcript, message in bad:
        with pytest.raises(InputError, match=message):
            backend.register_voice(path, transcript, "mine")
    assert backend.voices() == before and not voices_dir.exists()
    with pytest.raises(UnknownVoiceError):
        backend.book.get("nobody")
    with pytest.raises(UnknownVoiceError):
        backend.delete_voice("nobody")

    assert backend.register_voice(tmp_path / "ok.wav", "Hello world.", "mine") == "mine"
    with pytest.raises(InputError, match="already exists"):
        backend.register_voice(tmp_path / "ok.wav", "Hello world.", "mine")
    voice = backend.book.get("mine")
    assert voice.prompt_tokens == 50 and voice.prompt_feat.shape == (1, 100, 80)  # 2 s at 25 Hz, 2:1
    assert voice.llm_prompt_tokens == tuple(voice.flow_prompt_tokens[0].tolist())
    assert voice.prompt_text_tokens == tuple(model.text_frontend.encode("Hello world."))
    reloaded = CosyVoice2Backend(model, voices_dir=voices_dir).book.get("mine")
    assert torch.equal(reloaded.prompt_feat, voice.prompt_feat)
    assert reloaded.prompt_text_tokens == voice.prompt_text_tokens
    assert reloaded.flow_state.encoder.tokens == voice.flow_state.encoder.tokens == 25
    backend.delete_voice("mine")
    assert "mine" not in backend.voices() and list(voices_dir.iterdir()) == []


def test_factory_builds_the_cosyvoice2_engine_from_config(model, tmp_path):
    from voicertc.assemble import create_engine
    from voicertc.config import Config, EngineConfig, ScheduleConfig

    config = Config(
        engine=EngineConfig(
            backend="cosyvoice2", model_dir=str(model.model_dir), device="auto", voices_dir=str(tmp_path)
        ),
        schedule=ScheduleConfig(first_hop_tokens=13, grid_tokens=25),
    )
    engine = create_engine(config)
    engine.start()  # the backend (model load) is built on the worker thread
    try:
        assert isinstance(engine.backend, CosyVoice2Backend)
        assert engine.voices() == [SFT_VOICE]
        assert engine.backend.schedule == ChunkSchedule(first_hop_tokens=13, grid_tokens=25)
        assert engine.backend.model.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
        with pytest.raises(UnknownVoiceError):
            engine.resolve_voice("nobody")
    finally:
        engine.stop()
