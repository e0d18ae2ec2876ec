"""A CosyVoice2 vocoder step in parts under `[engine] max_step_ms` (issue 24, item 1).

On the full-size model on CPU one streaming HiFT chunk takes 0.3-0.6 s. `HiFTGenerator.decode_parts`
runs the network one upsampling stage per part and `hift_stream_step_parts` puts the excitation first
and the chunk tail last (the only part that writes the stream state); the backend holds a started batch
as a `PendingVocode` continued by its members, as a split flow chunk.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cv2_engine_helpers import GOLDEN_VOICE, build_speaking_model_dir, load_speaking_model, make_backend
from engine_helpers import EventLog, RecordingSink
from parts_helpers import one_second_clock, run_parts

from voicertc.backends.cosyvoice.hift.batch import hift_stream_step_batch, hift_stream_step_parts
from voicertc.backends.cosyvoice.hift.stream import hift_stream_step, init_hift_stream_state
from voicertc.engine import Cancelled, Done
from voicertc.engine.work import Vocode
from voicertc.engine.worker import EngineWorker

TEXT = "Zebras quietly jump over seven lazy dogs near Mount Vesuvius today."
TOKENS = 60


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory):
    torch.set_num_threads(2)
    return load_speaking_model(
        build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("vocode"))
    )


def mel_chunks(seed: int, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 80, n, generator=generator) - 4.0 for n in sizes]


def test_a_stream_vocoded_in_parts_equals_it_vocoded_whole(model):
    hift = model.hift
    sizes = (40, 36, 30)
    whole_state, split_state = init_hift_stream_state(), init_hift_stream_state()
    whole_gen, split_gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for index, mel in enumerate(mel_chunks(1, sizes)):
        final = index == len(sizes) - 1
        whole = hift_stream_step(hift, mel, whole_state, final, generator=whole_gen)
        (split,), parts = run_parts(hift_stream_step_parts(hift, [mel], [split_state], [final], [split_gen]))
        assert parts == 1 + len(hift.ups) + 1  # the excitation, each upsampling stage, the tail
        assert torch.equal(split, whole)
    assert split_state.finished and whole_state.finished


def test_a_batch_vocoded_in_parts_equals_it_vocoded_whole(model):
    hift = model.hift
    mels = mel_chunks(2, (44, 44))
    states = [init_hift_stream_state() for _ in range(4)]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 1, 2)]
    whole = hift_stream_step_batch(hift, mels, states[:2], [False, False], gens[:2])
    split, _ = run_parts(hift_stream_step_parts(hift, mels, states[2:], [False, False], gens[2:]))
    for a, b in zip(split, whole, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(states[2:], states[:2], strict=True):  # the state the next chunk reads, too
        assert torch.equal(a.speech_tail, b.speech_tail) and torch.equal(a.source_cache, b.source_cache)


def speak(backend, uids, on_unit=None):
    """Utterances spoken together; per engine unit: (work, rows)."""
    units: list[tuple[object, int]] = []
    run = backend.run
    engines: list[EngineWorker] = []

    def recorded(batch, now_s):
        results = run(batch, now_s)
        units.append((batch[0].work, len(batch)))
        if on_unit is not None:
            on_unit(engines[0], batch)
        return results

    backend.run = recorded
    engine = EngineWorker(backend, default_voice=GOLDEN_VOICE, name="cv2-vocode-parts")
    engines.append(engine)
    log, sinks = EventLog(), {uid: RecordingSink() for uid in uids}
    engine.start()
    try:
        for uid in uids:
            engine.open_utterance(GOLDEN_VOICE, sinks[uid], log, utterance_id=uid)
        for uid in uids:
            engine.push_text(uid, TEXT, end=True)
        log.wait_terminal(list(uids), timeout_s=300)
    finally:
        engine.stop()
    return log, {uid: sinks[uid].samples(uid) for uid in uids}, units


def budgeted(model, golden_dir):
    return make_backend(
        model, golden_dir, max_segment_tokens=TOKENS, max_step_ms=1500, step_clock=one_second_clock()
    )


@pytest.fixture(scope="module")
def whole_audio(model, golden_dir):
    log, audio, _ = speak(make_backend(model, golden_dir, max_segment_tokens=TOKENS), ("a", "b"))
    assert all(isinstance(log.of(uid)[-1], Done) for uid in ("a", "b"))
    return audio


def same_audio(got: np.ndarray, whole: np.ndarray) -> None:
    assert got.size == whole.size == TOKENS * 960
    np.testing.assert_allclose(got, whole, atol=2e-3, rtol=0)  # batch partners may differ: float32 rounding


def test_vocoder_units_go_a_part_at_a_time_and_speak_the_same(model, golden_dir, whole_audio):
    backend = budgeted(model, golden_dir)
    log, audio, units = speak(backend, ("a", "b"))
    for uid in ("a", "b"):
        assert isinstance(log.of(uid)[-1], Done)
        same_audio(audio[uid], whole_audio[uid])
    vocodes = [(work, rows) for work, rows in units if isinstance(work, Vocode)]
    started = [w for w, _ in vocodes if not w.solve]
    continued = [w for w, _ in vocodes if w.solve]
    assert len(continued) == len(started) * (len(model.hift.ups) + 1)  # every step went in parts
    assert any(rows == 2 and work.solve for work, rows in vocodes)  # a batch continued together
    assert backend._active == {}


def test_a_member_cancelled_mid_vocoder_step_leaves_the_other_speaking(model, golden_dir, whole_audio):
    backend = budgeted(model, golden_dir)
    cancelled: list[int] = []

    def cancel_inside_a_shared_step(engine, batch):
        work = batch[0].work
        if not cancelled and isinstance(work, Vocode) and work.solve and len(batch) == 2:
            cancelled.append(work.solve)
            engine.cancel("b")

    log, audio, units = speak(backend, ("a", "b"), on_unit=cancel_inside_a_shared_step)
    assert cancelled, "the two utterances never shared a split vocoder step"
    assert isinstance(log.of("b")[-1], Cancelled) and isinstance(log.of("a")[-1], Done)
    assert [rows for work, rows in units if isinstance(work, Vocode) and work.solve == cancelled[0]][-1] == 1
    same_audio(audio["a"], whole_audio["a"])
    assert backend._active == {} and backend.kv.in_use == 0


def test_a_failure_inside_a_shared_vocoder_step_vocodes_each_member_again(
    model, golden_dir, whole_audio, monkeypatch
):
    backend = budgeted(model, golden_dir)
    original, failed = model.hift._up_stage, []

    def fails_once_in_a_batch(i, x, source_stft):
        if not failed and x.shape[0] == 2 and i == 1:
            failed.append(i)
            raise RuntimeError("injected HiFT failure")
        return original(i, x, source_stft)

    monkeypatch.setattr(model.hift, "_up_stage", fails_once_in_a_batch)
    log, audio, _ = speak(backend, ("a", "b"))
    assert failed and backend.stats["batch_fallbacks"] >= 1
    for uid in ("a", "b"):
        assert isinstance(log.of(uid)[-1], Done), log.of(uid)[-1]
        same_audio(audio[uid], whole_audio[uid])  # the step again, alone: the same audio
