"""The cosyvoice3 backend behind the real EngineWorker on the tiny v3 directory
(`bench.make_tiny_model_dir --version 3`): whole text and text deltas speak with one Done, the prompt
always carries `<|endofprompt|>`, voice registration, and the factory builds it from the config."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import soundfile
import torch
from engine_helpers import EventLog, RecordingSink

from bench.make_tiny_cv3_model_dir import make_tiny_cv3_model_dir
from bench.make_tiny_model_dir import SFT_VOICE
from voicertc.backends.cosyvoice.llm.v3 import ENDOFPROMPT_ID
from voicertc.backends.cosyvoice.serve.backend import BackendOptions
from voicertc.backends.cosyvoice.serve.backend_v3 import CosyVoice3Backend, v3_prompt
from voicertc.backends.cosyvoice.voice.voices import voice_from_features, voice_from_wav
from voicertc.backends.cosyvoice3 import load
from voicertc.engine import Done, FirstAudio
from voicertc.engine.worker import EngineWorker

TEXT = "Hello world, this is a tiny test."
TOKEN_SAMPLES = 960  # 2 mel frames x 480 samples per speech token


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_cv3_model_dir(tmp_path_factory.mktemp("cv3_speak"))


@pytest.fixture(scope="module")
def model(model_dir):
    return load(model_dir, check_frontend=True)


def _backend(model, **options) -> CosyVoice3Backend:
    return CosyVoice3Backend(model, options=BackendOptions(**{"seed": 7, **options}))


def test_whole_text_speaks_two_tokens_per_text_token(model):
    backend = _backend(model)
    engine = EngineWorker(backend, default_voice=SFT_VOICE)
    log, sink = EventLog(), RecordingSink()
    engine.start()
    try:
        uid = engine.open_utterance(None, sink, log)
        engine.push_text(uid, TEXT, end=True)
        log.wait_terminal([uid], timeout_s=300)
    finally:
        engine.stop()
    events = log.of(uid)
    assert [type(e) for e in events] == [FirstAudio, Done]
    pcm = sink.samples(uid)
    text_tokens = len(model.text_frontend.encode(TEXT))
    assert len(pcm) == 2 * text_tokens * TOKEN_SAMPLES  # the tiny LLM stops at min_len (2 per text token)
    assert np.isfinite(pcm).all() and np.abs(pcm).max() > 1e-3 and np.abs(pcm).max() <= 1.0
    assert backend._active == {}


def test_every_prompt_carries_endofprompt(model):
    sft = voice_from_features(
        model, torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, 80), torch.ones(1, 192)
    )
    encode = model.text_frontend.encode
    for prompt in (v3_prompt(sft, "", encode), v3_prompt(sft, "Speak slowly.", encode)):
        assert ENDOFPROMPT_ID in prompt.text_ids and prompt.speech_ids == ()


def test_text_deltas_speak_before_the_text_ends(model):
    backend = _backend(model)
    engine = EngineWorker(backend, default_voice=SFT_VOICE)
    log, sink, first = EventLog(), RecordingSink(), threading.Event()
    engine.start()
    try:

        def on_event(event):
            log(event)
            if isinstance(event, FirstAudio):
                first.set()

        uid = engine.open_utterance(None, sink, on_event)
        engine.push_text(uid, "This is the first sentence of many. And ")
        assert first.wait(120), "no audio before the end of the text stream"
        assert backend._active[uid].backend_state.mode == "deltas"
        engine.push_text(uid, "then it ends.", end=True)
        log.wait_terminal([uid], timeout_s=300)
    finally:
        engine.stop()
    assert [type(e) for e in log.of(uid)] == [FirstAudio, Done]
    spoken = len(model.text_frontend.encode("This is the first sentence of many.")) + len(
        model.text_frontend.encode("And then it ends.")
    )
    # bistream: 15 speech tokens per full group of 5 text tokens; the rest (< 5) says nothing here
    assert sink.samples(uid).size == 15 * (spoken // 5) * TOKEN_SAMPLES


def test_zero_shot_voice_from_a_recording(model, tmp_path):
    t = np.arange(2 * 24000) / 24000
    wav = (0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    soundfile.write(str(tmp_path / "p.wav"), wav, 24000)
    voice = voice_from_wav(model, tmp_path / "p.wav", "Hello world.")
    assert voice.prompt_text.endswith("Hello world.") and ENDOFPROMPT_ID in voice.prompt_text_tokens
    assert voice.prompt_tokens == 50 and voice.prompt_feat.shape == (1, 100, 80)
    tokens = list(
        model.llm.generate(
            model.text_frontend.encode("Hi."), voice.prompt_text_tokens, voice.llm_prompt_tokens
        )
    )
    assert len(tokens) == 2 * len(model.text_frontend.encode("Hi."))


def test_factory_builds_the_cosyvoice3_engine_from_config(model_dir, tmp_path):
    """The factory takes CosyVoice2's `[engine]` keys (it once took two: `cuda_graphs` and `text_workers`
    did nothing for v3); the text is prepared in a spawned process with v3's frontend."""
    from voicertc.assemble import create_engine
    from voicertc.backends.cosyvoice.serve.backend import backend_options
    from voicertc.backends.cosyvoice.voice.text_prep import ProcessTextPrep
    from voicertc.config import Config, EngineConfig

    config = Config(
        engine=EngineConfig(
            backend="cosyvoice3", model_dir=str(model_dir), voices_dir=str(tmp_path), text_workers=1,
            max_step_ms=150, bistream_unit="sentence", max_batch=4, graph_memory_mb=64.0,
        )
    )  # fmt: skip
    engine = create_engine(config)
    engine.start()
    try:
        backend = engine.backend
        assert isinstance(backend, CosyVoice3Backend) and backend.name == "cosyvoice3"
        assert engine.voices() == [SFT_VOICE]
        options = backend.options
        assert options == backend_options(config)
        assert (options.text_workers, options.max_step_ms, options.bistream_unit) == (1, 150, "sentence")
        assert (options.graph_rows, options.graph_memory_mb) == (4, 64.0)
        assert isinstance(backend.text_prep, ProcessTextPrep)
        log, sink = EventLog(), RecordingSink()
        uid = engine.say(SFT_VOICE, sink, log, TEXT)
        log.wait_terminal([uid], timeout_s=120)
        assert isinstance(log.of(uid)[-1], Done) and sink.samples(uid).size > 0
    finally:
        engine.stop()


def _speak(model, uids: list[str], monkeypatch) -> tuple[dict[str, np.ndarray], list[int]]:
    """Say TEXT as each utterance id at once on one engine; -> PCM per id, rows of every HiFT batch."""
    from voicertc.backends.cosyvoice.serve import backend_v3

    batches: list[int] = []

    def recording(streams, *args, **kwargs):
        batches.append(len(streams))
        return backend_v3_vocode(streams, *args, **kwargs)

    backend_v3_vocode = backend_v3.vocode_batch_v3
    monkeypatch.setattr(backend_v3, "vocode_batch_v3", recording)
    engine = EngineWorker(_backend(model, flow_batch_rows=1), default_voice=SFT_VOICE)  # flow alone
    log, sinks = EventLog(), {uid: RecordingSink() for uid in uids}
    engine.start()
    try:
        for uid in uids:
            engine.open_utterance(None, sinks[uid], log, utterance_id=uid)
            engine.push_text(uid, TEXT * 3, end=True)
        log.wait_terminal(uids, timeout_s=300)
    finally:
        engine.stop()
        monkeypatch.undo()
    return {uid: sinks[uid].samples(uid) for uid in uids}, batches


def test_vocoder_rows_batch_across_utterances_as_alone(model, monkeypatch):
    """Two utterances at once share HiFT forwards (`vocode_batch_v3`); each speaks what it speaks alone
    (its own LLM seed; the batched convolutions round differently, <= 1e-5). The flow runs each row
    alone here: a batched estimator moves the mel by ~1e-6, which f0's gain turns into ~1e-3."""
    together, batches = _speak(model, ["a", "b"], monkeypatch)
    alone, none = _speak(model, ["a"], monkeypatch)
    assert batches and all(rows == 2 for rows in batches) and not none
    assert len(together["a"]) == len(alone["a"]) > 0
    np.testing.assert_allclose(together["a"], alone["a"], atol=1e-5, rtol=0)
    assert not np.allclose(together["a"][: len(together["b"])], together["b"][: len(together["a"])])


def test_the_warm_up_is_cosyvoice2s_with_v3s_prompt(model):
    """One warm-up for both versions: the captured stages' buckets (CUDA graphs) are warmed before the
    engine says ready for v3 too (its own warm-up once skipped them: tests/test_gpu_captured.py checks
    the captures on CUDA); only the prefilled ids differ."""
    from voicertc.backends.cosyvoice.serve.backend import CosyVoice2Backend

    assert CosyVoice3Backend.warm_up is CosyVoice2Backend.warm_up
    assert CosyVoice3Backend.warm_up_prompt_ids[0] == ENDOFPROMPT_ID
    _backend(model).warm_up()  # on CPU: one LLM step on the v3 layout, one flow + vocoder chunk


def _speak_three(model, **options):
    backend = _backend(model, max_segment_tokens=60, **options)
    stages = backend.captured
    engine = EngineWorker(backend, default_voice=SFT_VOICE)
    log, sinks = EventLog(), {uid: RecordingSink() for uid in "abc"}
    engine.start()
    try:
        for uid, sink in sinks.items():
            engine.open_utterance(None, sink, log, utterance_id=uid)
            engine.push_text(uid, TEXT, end=True)
        log.wait_terminal(list(sinks), timeout_s=300)
    finally:
        engine.stop()
    for uid in sinks:
        assert [type(e) for e in log.of(uid)] == [FirstAudio, Done], uid
    return backend, stages, {uid: sink.samples(uid) for uid, sink in sinks.items()}


def test_static_shape_dit_and_causal_hift_steps_speak_as_eager(model):
    """The path `[engine] cuda_graphs` captures on CUDA (the DiT's Euler steps and the causal HiFT's
    synthesis), uncaptured on CPU: three utterances at once speak what the eager engine speaks."""
    static, stages, got = _speak_three(model, static_steps=True, graph_rows=4)
    assert model.hift.synthesis_runner is None and model.flow.decoder.estimator_runner is None  # closed
    assert static.captured is None  # the stages came off the model with the engine
    stats = stages.stats()
    assert stats["vocoder"].replays > 0 and stats["flow"].replays > 0
    assert stats["vocoder"].failed is None and {key[0] for key in stats["vocoder"].by_shape} <= {1, 2, 4}
    assert 1 <= stats["vocoder"].eager <= 3  # the final chunks (one call per batch of them)
    _, _, eager = _speak_three(model)
    for uid in "abc":
        a, b = got[uid], eager[uid]
        assert a.size == b.size > 0
        np.testing.assert_allclose(a, b, atol=2e-3, rtol=0)  # row padding: float32 rounding, as batching
