"""A streaming flow chunk split across engine steps under `[engine] max_step_ms` (issue 24, item 1).

On a slow machine (the full-size model on CPU: ~0.5 s an Euler step) a chunk's ten Euler steps, each in
parts (one estimator stage per part), go on in later units, the batch's members continued together, and
a decode burst stops early; the audio is what one-unit chunks make. A clock injected into the backend
makes every step look like one second, so each unit makes exactly one part (or one decode token) on the
tiny model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cv2_engine_helpers import (
    GOLDEN_VOICE,
    SFT_VOICE,
    build_speaking_model_dir,
    golden_voice,
    load_speaking_model,
    make_backend,
)
from engine_helpers import EventLog, RecordingSink
from parts_helpers import one_second_clock
from safetensors.torch import load_file

from voicertc.engine import Cancelled, Done
from voicertc.engine.work import Decode, FlowChunk
from voicertc.engine.worker import EngineWorker

TEXT = "Zebras quietly jump over seven lazy dogs near Mount Vesuvius today."
TOKENS = 60  # a first chunk of 33 + pad, then the final one
JOBS = [("a", "golden"), ("b", "golden"), ("c", "sft")]
VOICES = {"golden": GOLDEN_VOICE, "sft": SFT_VOICE}
TOKEN_SAMPLES = 960


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory):
    return load_speaking_model(
        build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("split"))
    )


def count_parts(decoder, monkeypatch) -> list[int]:
    """Count the solver's parts (`advance_part` calls: one estimator stage each on the eager estimator)."""
    calls: list[int] = []
    original = decoder.advance_part

    def counted(solve):
        calls.append(1)
        return original(solve)

    monkeypatch.setattr(decoder, "advance_part", counted)
    return calls


def parts_per_step(decoder) -> int:
    """An Euler step's parts: the estimator's stages (UNet) or blocks (DiT), then the output projection."""
    estimator = decoder.estimator
    return (estimator.n_stages if hasattr(estimator, "n_stages") else len(estimator.transformer_blocks)) + 1


class UnitLog:
    """Per engine unit: its work, the rows in it, flow solver parts and LLM decode steps."""

    def __init__(self, backend, model, monkeypatch) -> None:
        self.units: list[tuple[object, int, int, int]] = []
        self.on_unit = None
        self._parts = count_parts(model.flow.decoder, monkeypatch)
        run = backend.run

        def recorded(batch, now_s):
            parts_before, decodes_before = len(self._parts), backend.stats["decode_batches"]
            results = run(batch, now_s)
            decodes = backend.stats["decode_batches"] - decodes_before
            self.units.append((batch[0].work, len(batch), len(self._parts) - parts_before, decodes))
            if self.on_unit is not None:
                self.on_unit(batch)
            return results

        monkeypatch.setattr(backend, "run", recorded)

    def flows(self):
        return [u for u in self.units if isinstance(u[0], FlowChunk)]


@pytest.fixture
def unit_log(model, monkeypatch):
    return lambda backend: UnitLog(backend, model, monkeypatch)


def speak(backend, jobs, on_start=None):
    engine = EngineWorker(backend, default_voice=GOLDEN_VOICE, name="cv2-split")
    log, sinks = EventLog(), {}
    engine.start()
    try:
        if on_start is not None:
            on_start(engine)
        for uid, voice in jobs:
            sinks[uid] = RecordingSink()
            engine.open_utterance(voice, sinks[uid], log, utterance_id=uid)
        for uid, _ in jobs:
            engine.push_text(uid, TEXT, end=True)
        log.wait_terminal([uid for uid, _ in jobs], timeout_s=300)
    finally:
        engine.stop()
    return log, sinks


def test_a_stream_chunk_solved_one_euler_step_at_a_time_equals_the_chunk_at_once(model, golden_dir):
    tokens = load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")["in_token"]
    assert tokens.shape[1] >= 61
    voice = golden_voice(model, golden_dir)
    flow, steps = model.flow, model.flow.cfg.n_timesteps
    a, b = voice.flow_state.clone(), voice.flow_state.clone()
    at_once = flow.stream_step_batch([tokens[:, :36], tokens[:, :36]], [a, b], finalize=False)
    a2, b2 = voice.flow_state.clone(), voice.flow_state.clone()
    stream = flow.start_stream_batch([tokens[:, :36], tokens[:, :36]], [a2, b2], finalize=False)
    parts = [flow.advance_stream(stream, euler_steps=1) for _ in range(steps)]
    assert all(p is None for p in parts[:-1]) and parts[-1] is not None
    for split, whole in zip(parts[-1], at_once, strict=True):
        assert torch.equal(split, whole)
    for left, right in ((a, a2), (b, b2)):  # the caches the next chunk reads are the same too
        assert left.frames == right.frames and left.encoder.tokens == right.encoder.tokens
        nxt = flow.stream_step(tokens[:, 33:61], left, finalize=True)  # the lookahead again, then more
        assert torch.equal(nxt, flow.stream_step(tokens[:, 33:61], right, finalize=True))


def test_a_stream_chunk_solved_one_estimator_stage_at_a_time_equals_the_chunk_at_once(model, golden_dir):
    tokens = load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")["in_token"]
    voice = golden_voice(model, golden_dir)
    flow = model.flow
    per_step = parts_per_step(flow.decoder)
    assert per_step >= 3  # down, mid stage(s), up, then the projection
    a, b = voice.flow_state.clone(), voice.flow_state.clone()
    at_once = flow.stream_step_batch([tokens[:, :36], tokens[:, :36]], [a, b], finalize=False)
    a2, b2 = voice.flow_state.clone(), voice.flow_state.clone()
    stream = flow.start_stream_batch([tokens[:, :36], tokens[:, :36]], [a2, b2], finalize=False)
    total = flow.cfg.n_timesteps * per_step
    mels = [flow.advance_stream(stream, parts=1) for _ in range(total)]
    assert all(m is None for m in mels[:-1]) and mels[-1] is not None
    assert stream.solve is not None and stream.solve.step == flow.cfg.n_timesteps
    for split, whole in zip(mels[-1], at_once, strict=True):
        assert torch.equal(split, whole)
    for left, right in ((a, a2), (b, b2)):
        nxt = flow.stream_step(tokens[:, 33:61], left, finalize=True)
        assert torch.equal(nxt, flow.stream_step(tokens[:, 33:61], right, finalize=True))
    # whole Euler steps after a step begun in parts: the begun step is finished first, counted as one
    alone = flow.stream_step(tokens[:, :36], voice.flow_state.clone(), finalize=False)
    stream = flow.start_stream_batch([tokens[:, :36]], [voice.flow_state.clone()], finalize=False)
    assert flow.advance_stream(stream, parts=2) is None and stream.solve.step == 0
    assert flow.advance_stream(stream, euler_steps=1) is None and stream.solve.step == 1
    assert torch.equal(flow.advance_stream(stream)[0], alone)


@pytest.fixture(scope="module")
def whole_audio(model, golden_dir):
    """The three utterances with every chunk in one unit (the reference the split runs must speak)."""
    jobs = [(uid, VOICES[kind]) for uid, kind in JOBS]
    _, sinks = speak(make_backend(model, golden_dir, max_segment_tokens=TOKENS), jobs)
    return {uid: sinks[uid].samples(uid) for uid, _ in jobs}


def same_audio(got: np.ndarray, whole: np.ndarray) -> None:
    assert got.size == whole.size == TOKENS * TOKEN_SAMPLES
    np.testing.assert_allclose(got, whole, atol=2e-3, rtol=0)  # batch partners may differ: float32 rounding


def test_split_units_speak_what_whole_chunks_speak_and_each_makes_one_step(
    model, golden_dir, unit_log, whole_audio
):
    jobs = [(uid, VOICES[kind]) for uid, kind in JOBS]
    split = make_backend(
        model, golden_dir, max_segment_tokens=TOKENS, max_step_ms=1500, step_clock=one_second_clock()
    )
    log_units = unit_log(split)
    log, sinks_split = speak(split, jobs)
    for uid, _ in jobs:
        assert isinstance(log.of(uid)[-1], Done)
        same_audio(sinks_split[uid].samples(uid), whole_audio[uid])
    flows = log_units.flows()
    assert flows and max(parts for _, _, parts, _ in flows) == 1  # one estimator stage per unit
    chunks = sum(1 for work, rows, _, _ in flows if not work.solve for _ in range(rows))
    per_chunk = model.flow.cfg.n_timesteps * parts_per_step(model.flow.decoder)
    assert sum(rows for _, rows, _, _ in flows) == chunks * per_chunk
    assert any(rows > 1 and work.solve for work, rows, _, _ in flows)  # a batch continued together
    assert split.stats["batched_chunks"] >= 2
    decodes = [d for work, _, _, d in log_units.units if isinstance(work, Decode)]
    assert decodes and max(decodes) == 1  # a decode burst stops after one token too


def test_a_member_cancelled_mid_chunk_leaves_the_others_speaking(model, golden_dir, unit_log, whole_audio):
    jobs = [("a", GOLDEN_VOICE), ("b", GOLDEN_VOICE)]  # b is cancelled
    split = make_backend(
        model, golden_dir, max_segment_tokens=TOKENS, max_step_ms=1500, step_clock=one_second_clock()
    )
    log_units = unit_log(split)
    engines = []
    cancelled = []

    def cancel_inside_a_shared_chunk(batch):
        work = batch[0].work
        if not cancelled and isinstance(work, FlowChunk) and work.solve and len(batch) == 2:
            cancelled.append(work.solve)
            engines[0].cancel("b")

    log_units.on_unit = cancel_inside_a_shared_chunk
    log, sinks = speak(split, jobs, on_start=engines.append)
    assert cancelled, "the two utterances never shared a split chunk"
    assert isinstance(log.of("b")[-1], Cancelled)
    assert isinstance(log.of("a")[-1], Done)
    rest = [rows for work, rows, _, _ in log_units.flows() if work.solve == cancelled[0]]
    assert rest[-1] == 1  # the chunk went on with its remaining member only
    same_audio(sinks["a"].samples("a"), whole_audio["a"])
    assert split._active == {}


def test_a_failed_step_inside_a_shared_chunk_starts_it_again_for_every_member(
    model, golden_dir, monkeypatch, whole_audio
):
    jobs = [("a", GOLDEN_VOICE), ("b", GOLDEN_VOICE)]
    split = make_backend(
        model, golden_dir, max_segment_tokens=TOKENS, max_step_ms=1500, step_clock=one_second_clock()
    )
    original, failed = model.flow.advance_stream, []

    def fails_once_mid_chunk(stream, euler_steps=None, parts=None):
        solve = stream.solve
        if not failed and len(stream.states) == 2 and solve is not None and solve.step == 4 and solve.parts:
            failed.append(solve.step)  # inside Euler step 4, after some of its parts
            raise RuntimeError("injected estimator failure")
        return original(stream, euler_steps, parts=parts)

    monkeypatch.setattr(model.flow, "advance_stream", fails_once_mid_chunk)
    log, sinks = speak(split, jobs)
    assert failed and split.stats["batch_fallbacks"] == 1
    for uid, _ in jobs:
        assert isinstance(log.of(uid)[-1], Done), log.of(uid)[-1]
        same_audio(sinks[uid].samples(uid), whole_audio[uid])  # the restarted chunk: the same mel


def test_cosyvoice3_splits_its_dit_chunks_the_same_way(tmp_path_factory):
    """The mechanism is shared: CosyVoice3's DiT chunks go one DiT block per unit and speak the same."""
    from bench.make_tiny_cv3_model_dir import make_tiny_cv3_model_dir
    from voicertc.backends.cosyvoice.serve.backend import BackendOptions
    from voicertc.backends.cosyvoice.serve.backend_v3 import CosyVoice3Backend
    from voicertc.backends.cosyvoice3 import load as load_v3

    model = load_v3(make_tiny_cv3_model_dir(tmp_path_factory.mktemp("cv3_split")))
    jobs = [("a", SFT_VOICE), ("b", SFT_VOICE)]
    audio = {}
    with pytest.MonkeyPatch.context() as patch:
        forwards = count_parts(model.flow.decoder, patch)
        for name, extra in (
            ("whole", {}),
            ("split", {"max_step_ms": 1500, "step_clock": one_second_clock()}),
        ):
            backend = CosyVoice3Backend(
                model, options=BackendOptions(seed=7, max_segment_tokens=TOKENS, **extra)
            )
            flows = []
            run = backend.run

            def recorded(batch, now_s, run=run, flows=flows):
                before = len(forwards)
                results = run(batch, now_s)
                if isinstance(batch[0].work, FlowChunk):
                    flows.append(len(forwards) - before)
                return results

            backend.run = recorded
            log, sinks = speak(backend, jobs)
            assert all(isinstance(log.of(uid)[-1], Done) for uid, _ in jobs)
            audio[name] = {uid: sinks[uid].samples(uid) for uid, _ in jobs}
            if name == "split":
                assert flows and max(flows) == 1  # one DiT block (both CFG rows, the batch) per unit
                assert sum(flows) % parts_per_step(model.flow.decoder) == 0
    for uid, _ in jobs:
        same_audio(audio["split"][uid], audio["whole"][uid])
