"""A voice's prompt caches built in bounded parts, never in one engine step.

The flow's state after a prompt is ten Euler steps with CFG over every prompt frame (seconds on the
full-size model on a CPU); it used to be built in one go on the engine thread, at registration or at a
stored voice's first use, stalling every call speaking meanwhile. Now `CausalFlow.init_stream_parts`
builds it an encoder pass, then an estimator stage (or Euler step) at a time; a registration is an engine
command in parts and a stored voice's first utterance builds it in `VoicePrompt` units under
`[engine] max_step_ms`. The prompt is streamed a grid chunk at a time, as an utterance's own chunks
are, so a part never spans more than one chunk's estimator stage whatever the prompt's length; the
state equals the one-pass computation within rounding (1e-5 on the next chunk's mel).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from cv2_engine_helpers import (
    GOLDEN_VOICE,
    build_speaking_model_dir,
    load_speaking_model,
    make_backend,
    tone_clip,
)
from engine_helpers import EventLog, RecordingSink
from parts_helpers import one_second_clock, run_parts
from transformers.cache_utils import DynamicCache

from voicertc.backends.cosyvoice.flow.flow import _Chunk
from voicertc.backends.cosyvoice.llm.qwen2lm import SOS_ROW
from voicertc.backends.cosyvoice.voice.voices import VoiceBook, VoiceFeatures, VoiceStore
from voicertc.engine import Done
from voicertc.engine.work import VoicePrompt
from voicertc.engine.worker import EngineWorker
from voicertc.errors import InputError

TEXT = "Zebras quietly jump over seven lazy dogs."
VOICE = "six-seconds"


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory):
    torch.set_num_threads(2)
    return load_speaking_model(
        build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("voice-parts"))
    )


@pytest.fixture(scope="module")
def features(model) -> VoiceFeatures:
    return VoiceBook(model, None).prepare(tone_clip(6.0, 170), "A prompt of six seconds.", VOICE)


@pytest.fixture(scope="module")
def voices_dir(model, features, tmp_path_factory):
    """The six-second voice on disk, as a server that ran before left it."""
    directory = tmp_path_factory.mktemp("voices")
    VoiceBook(model, VoiceStore(directory)).install(features)
    return directory


def _whole_prompt_state(flow, features):
    """The prompt state as it was built before parts: one `_run` over the prompt's ready chunks."""
    state = flow._new_state(features.tokens, features.feat, features.embedding)
    lookahead, grid = flow.cfg.pre_lookahead_tokens, flow.cfg.chunk_tokens
    prompt = state.pending_prompt
    ready = (prompt.shape[1] - lookahead) // grid * grid
    with torch.inference_mode():
        flow._run([_Chunk(state, prompt[:, :ready], prompt[:, ready : ready + lookahead], 2 * ready)], True)
    state.pending_prompt = prompt[:, ready:]
    return state


def test_the_prompt_streamed_in_bounded_parts_is_the_whole_forward(model, features):
    flow = model.flow
    whole = _whole_prompt_state(flow, features)
    parted, calls = run_parts(flow.init_stream_parts(features.tokens, features.feat, features.embedding))
    chunks = whole.frames // (2 * flow.cfg.chunk_tokens)
    assert chunks >= 4  # the six-second prompt: several grid chunks
    assert calls > chunks * flow.decoder.n_timesteps  # a part never spans more than one chunk's step
    assert whole.frames == parted.frames > 0
    assert torch.equal(whole.pending_prompt, parted.pending_prompt)
    speech = torch.randint(0, flow.cfg.vocab_size, (1, 28), generator=torch.Generator().manual_seed(5))
    mels = [flow.stream_step(speech, state.clone(), finalize=False) for state in (whole, parted)]
    assert mels[0].shape[2] > 0
    assert (mels[0] - mels[1]).abs().max().item() <= 1e-5  # the same function, summed chunk by chunk


def test_a_bad_prompt_is_refused_before_any_part(model, features):
    short_feat = features.feat[:, :-2]
    with pytest.raises(ValueError, match="frames"):
        model.flow.init_stream_parts(features.tokens, short_feat, features.embedding)  # no next() needed
    book = VoiceBook(model, None)
    bad = VoiceFeatures("bad-prompt", features.tokens, short_feat, features.embedding, "Bad.", (1, 2))
    with pytest.raises(InputError, match="bad voice prompt"):
        book.install_parts(bad)
    assert "bad-prompt" not in book.ids()


def test_a_registration_runs_in_parts_between_a_speaking_calls_units(model, golden_dir, tmp_path):
    backend = make_backend(model, golden_dir, tmp_path / "voices")
    order: list[str] = []
    run, install_parts = backend.run, backend.book.install_parts

    def recorded_run(batch, now_s):
        order.append("unit")
        return run(batch, now_s)

    first_part = threading.Event()

    def recorded_install(prepared):
        parts = install_parts(prepared)

        def each():
            while True:
                order.append("part")
                first_part.set()
                try:
                    next(parts)
                except StopIteration as end:
                    return end.value
                yield

        return each()

    backend.run, backend.book.install_parts = recorded_run, recorded_install
    engine = EngineWorker(backend, name="cv2-voice-parts")
    engine.start()
    try:
        log, sink = EventLog(), RecordingSink()
        registered = engine.register_voice(tone_clip(6.0, 170), "A prompt of six seconds.", VOICE, "")
        assert first_part.wait(120)  # the registration's model work has begun: a call starts now
        speaking = engine.open_utterance(None, sink, log)
        engine.push_text(speaking, TEXT, end=True)
        info = registered.result(120)
        assert info["id"] == VOICE and VOICE in engine.voices()
        log.wait_terminal([speaking], 300)
        assert isinstance(log.of(speaking)[-1], Done)
        parts = [i for i, what in enumerate(order) if what == "part"]
        between = order[parts[0] : parts[-1]].count("unit")
        assert len(parts) > model.flow.decoder.n_timesteps and between > 0  # never all parts in one go
        assert backend.book.get(VOICE).caches.ready
        heard = engine.open_utterance(VOICE, RecordingSink(), log)  # the new voice speaks
        engine.push_text(heard, "Hello.", end=True)
        log.wait_terminal([heard], 300)
        assert isinstance(log.of(heard)[-1], Done)
    finally:
        engine.stop()


def _speak(backend, utterance_ids, voice=VOICE):
    """Utterances on `voice` at once; their PCM and every unit's work."""
    units = []
    run = backend.run

    def recorded(batch, now_s):
        units.append([job.work for job in batch])
        if isinstance(batch[0].work, VoicePrompt):  # preparing the voice counts no synthesis steps
            assert all(job.utt.steps <= 1 for job in batch)  # the Frontend unit before it only
        return run(batch, now_s)

    backend.run = recorded
    engine = EngineWorker(backend, name="cv2-voice-first-use")
    log, sinks = EventLog(), {uid: RecordingSink() for uid in utterance_ids}  # a sink each: at once
    engine.start()
    try:
        for uid in utterance_ids:
            engine.open_utterance(voice, sinks[uid], log, utterance_id=uid)
        for uid in utterance_ids:
            engine.push_text(uid, TEXT, end=True)
        log.wait_terminal(list(utterance_ids), timeout_s=300)
    finally:
        engine.stop()
    for uid in utterance_ids:
        assert isinstance(log.of(uid)[-1], Done), log.of(uid)[-1]
    return [sinks[uid].samples(uid) for uid in utterance_ids], units


def test_a_stored_voice_builds_its_prompt_in_units_and_speaks_as_one_built_whole(
    model, golden_dir, voices_dir, features
):
    built = make_backend(model, golden_dir, voices_dir)
    built.book.get(VOICE).caches.build()  # in one go, before any utterance
    (expected,), built_units = _speak(built, ["u"])
    assert not any(isinstance(w, VoicePrompt) for batch in built_units for w in batch)

    lazy = make_backend(model, golden_dir, voices_dir, max_step_ms=1500, step_clock=one_second_clock())
    caches = lazy.book.get(VOICE).caches
    assert not caches.built  # loaded from disk: nothing built yet
    (pcm,), units = _speak(lazy, ["u"])
    prompt_units = [batch for batch in units if isinstance(batch[0], VoicePrompt)]
    assert len(prompt_units) == caches.parts_run + 1  # one part per unit under the budget (+ the last)
    assert caches.parts_run > model.flow.decoder.n_timesteps
    assert expected.size > 0 and np.array_equal(pcm, expected)  # the same audio


def test_utterances_of_one_unbuilt_voice_share_its_build(model, golden_dir, voices_dir):
    alone = make_backend(model, golden_dir, voices_dir, max_step_ms=1500, step_clock=one_second_clock())
    _speak(alone, ["a"])
    parts_alone = alone.book.get(VOICE).caches.parts_run

    shared = make_backend(model, golden_dir, voices_dir, max_step_ms=1500, step_clock=one_second_clock())
    (first, second), units = _speak(shared, ["a", "b"])
    caches = shared.book.get(VOICE).caches
    assert caches.parts_run == parts_alone  # built once, not once per utterance
    prompt_units = [batch for batch in units if isinstance(batch[0], VoicePrompt)]
    assert len(prompt_units) == caches.parts_run + 1  # a unit of both advances the shared build once
    assert first.size > 0 and second.size > 0


def test_the_llm_prefix_in_parts_is_the_one_forward_prefix(model):
    llm = model.llm
    ids = list(range(40, 77))  # 37 transcript tokens + sos: 38 positions
    parted, calls = run_parts(llm.prefix_cache_parts(ids))
    layers = llm.llm.model.model.config.num_hidden_layers
    assert calls == layers + 1 and parted.prompt_text_tokens == tuple(ids)  # a decoder layer per part
    whole = DynamicCache()
    with torch.inference_mode():
        llm.llm(torch.cat([llm.special_embedding(SOS_ROW), llm.embed_text(ids)], dim=1), whole)
    assert parted.cache.get_seq_length() == whole.get_seq_length() == 38
    for mine, one in zip(parted.cache.layers, whole.layers, strict=True):
        assert (mine.keys - one.keys).abs().max().item() <= 1e-5
        assert (mine.values - one.values).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="text token"):
        llm.prefix_cache_parts([10**9])  # checked before any part


def test_an_utterance_waiting_for_its_text_builds_its_voice_meanwhile(model, golden_dir, voices_dir):
    backend = make_backend(model, golden_dir, voices_dir, max_step_ms=1500, step_clock=one_second_clock())
    caches = backend.book.get(VOICE).caches
    engine = EngineWorker(backend, name="cv2-voice-before-text")
    log, sink = EventLog(), RecordingSink()
    engine.start()
    try:
        uid = engine.open_utterance(VOICE, sink, log)  # no text yet: an agent's first delta is to come
        deadline = time.monotonic() + 120
        while not caches.ready and time.monotonic() < deadline:
            time.sleep(0.01)
        assert caches.ready and caches.parts_run > 0 and sink.samples(uid).size == 0
        engine.push_text(uid, "Hello there", end=False)
        engine.push_text(uid, " friend.", end=True)
        log.wait_terminal([uid], 300)
        assert isinstance(log.of(uid)[-1], Done) and sink.samples(uid).size > 0
    finally:
        engine.stop()


def test_a_call_waiting_for_admission_builds_its_voice_meanwhile(model, golden_dir, voices_dir):
    """Memory admission holds back what allocates an utterance's flow contexts, not its voice's build."""
    backend = make_backend(model, golden_dir, voices_dir, max_streaming=1)
    caches = backend.book.get(VOICE).caches
    log, ready_when_first_ended = EventLog(), []

    def on_event(event):
        if isinstance(event, Done) and event.utterance_id == "first":
            ready_when_first_ended.append(caches.ready)
        log(event)

    engine = EngineWorker(backend, name="cv2-voice-admission")
    engine.start()
    try:
        engine.open_utterance(GOLDEN_VOICE, RecordingSink(), on_event, utterance_id="first")
        engine.push_text("first", " ".join([TEXT] * 6), end=True)
        engine.open_utterance(VOICE, RecordingSink(), on_event, utterance_id="second")  # waits: cap 1
        engine.push_text("second", TEXT, end=True)
        log.wait_terminal(["first", "second"], 300)
    finally:
        engine.stop()
    assert [type(log.of(u)[-1]) for u in ("first", "second")] == [Done, Done]
    assert ready_when_first_ended == [True]
