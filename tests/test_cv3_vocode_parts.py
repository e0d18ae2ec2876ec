"""CosyVoice3's incremental causal HiFT in parts under `[engine] max_step_ms` (issue 24, item 1).

`CausalHiFTGenerator.step_rows_parts` yields after the excitation and `conv_pre` and after each
upsampling stage; `step_batch_parts` runs it on a merged copy of the rows' states and writes them back in
its last part only, so a cancel or a failure in between leaves every stream as it was. The engine holds
a started step as a `PendingVocode`, as CosyVoice2's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from cv2_engine_helpers import SFT_VOICE
from engine_helpers import EventLog, RecordingSink
from parts_helpers import one_second_clock, run_parts
from safetensors.torch import load_file

from voicertc.backends.cosyvoice.hift.causal import HiftStreamState
from voicertc.backends.cosyvoice.hift.causal_batch import step_batch, step_batch_parts
from voicertc.engine import Done
from voicertc.engine.work import Vocode
from voicertc.engine.worker import EngineWorker

REFERENCE = Path(__file__).parent / "data" / "cv3_long_reference.safetensors"
CHUNKS = [58, 100, 40]  # new mel frames per chunk; the last is final


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


def test_a_stream_in_parts_equals_it_whole_and_its_state_moves_only_at_the_end(cv3_model):
    hift = cv3_model.hift
    mel = load_file(REFERENCE)["stream_mel"][:, :, : sum(CHUNKS)]
    whole_state, split_states = HiftStreamState(), [HiftStreamState(), HiftStreamState()]
    start = 0
    for index, frames in enumerate(CHUNKS):
        piece, final = mel[:, :, start : start + frames], index == len(CHUNKS) - 1
        start += frames
        whole = hift.step(piece, whole_state, final=final)[0][0]
        emitted = split_states[0].emitted
        parts = step_batch_parts(hift, [piece, piece], split_states, final=final)
        with torch.inference_mode():
            next(parts)
            next(parts)
        assert split_states[0].emitted == emitted  # nothing written back before the last part
        split, count = run_parts(parts)
        assert count + 2 == 2 + len(hift.ups) + 1  # excitation, STFT + conv_pre, each stage, the tail
        for row in split:
            torch.testing.assert_close(row, whole, atol=1e-5, rtol=0.0)  # a batch of two rounds differently
    assert split_states[0].finished and whole_state.finished


def test_one_row_in_parts_equals_step_bit_for_bit(cv3_model):
    hift = cv3_model.hift
    mel = load_file(REFERENCE)["stream_mel"][:, :, 200 : 200 + sum(CHUNKS)]
    a, b = HiftStreamState(), HiftStreamState()
    start = 0
    for index, frames in enumerate(CHUNKS):
        piece, final = mel[:, :, start : start + frames], index == len(CHUNKS) - 1
        start += frames
        whole = step_batch(hift, [piece], [a], final=final)[0]
        (split,), _ = run_parts(step_batch_parts(hift, [piece], [b], final=final))
        assert torch.equal(split, whole)


def speak(backend, uid="u"):
    units: list[tuple[object, int]] = []
    run = backend.run

    def recorded(batch, now_s):
        results = run(batch, now_s)
        units.append((batch[0].work, len(batch)))
        return results

    backend.run = recorded
    engine = EngineWorker(backend, name="cv3-vocode-parts")
    log, sink = EventLog(), RecordingSink()
    engine.start()
    try:
        engine.open_utterance(SFT_VOICE, sink, log, utterance_id=uid)
        engine.push_text(uid, "Zebras quietly jump over seven lazy dogs.", end=True)
        log.wait_terminal([uid], timeout_s=300)
    finally:
        engine.stop()
    assert isinstance(log.of(uid)[-1], Done), log.of(uid)[-1]
    return sink.samples(uid), units


def test_the_engine_vocodes_v3_chunks_a_part_per_unit_with_the_same_audio(tmp_path_factory):
    from bench.make_tiny_cv3_model_dir import make_tiny_cv3_model_dir
    from voicertc.backends.cosyvoice.serve.backend import BackendOptions
    from voicertc.backends.cosyvoice.serve.backend_v3 import CosyVoice3Backend
    from voicertc.backends.cosyvoice3 import load as load_v3

    model = load_v3(make_tiny_cv3_model_dir(tmp_path_factory.mktemp("cv3_vocode")))
    whole, _ = speak(CosyVoice3Backend(model, options=BackendOptions(seed=7, max_segment_tokens=60)))
    options = BackendOptions(seed=7, max_segment_tokens=60, max_step_ms=1500, step_clock=one_second_clock())
    backend = CosyVoice3Backend(model, options=options)
    split, units = speak(backend)
    vocodes = [work for work, _ in units if isinstance(work, Vocode)]
    started, continued = [w for w in vocodes if not w.solve], [w for w in vocodes if w.solve]
    assert started and len(continued) == len(started) * (len(model.hift.ups) + 2)
    assert whole.size > 0 and np.array_equal(split, whole)
    assert backend._active == {}


def test_an_injected_excitation_is_refused_in_parts(cv3_model, cv3_records):
    """A parity run's `source_fn` stream is vocoded by `complete()`; the parts path would draw its own
    excitation, so it refuses (as CosyVoice2's batch does) before touching the stream."""
    from voicertc.backends.cosyvoice.serve.streams import token2wav_stream
    from voicertc.backends.cosyvoice.serve.token2wav import ChunkPlan
    from voicertc.backends.cosyvoice.serve.token2wav_v3 import vocode_batch_v3_parts
    from voicertc.backends.cosyvoice.voice.voices import voice_from_features

    tts = cv3_records("cv3_tts_stream.safetensors")
    voice = voice_from_features(cv3_model, tts["in_prompt_token"], tts["in_prompt_feat"], tts["in_embedding"])
    stream = token2wav_stream(cv3_model, voice, source_fn=lambda k: tts[f"stream_call{k}_hift_source"])
    plan = ChunkPlan(tts["in_token"][:, :0], 0, 0, final=False)
    before = stream.hift_state.emitted
    with pytest.raises(ValueError, match="source_fn"):
        run_parts(vocode_batch_v3_parts([stream], [plan], [torch.zeros(1, 80, 58)], [0.0]))
    assert stream.hift_state.emitted == before and stream.chunk_index == 0
