"""A CosyVoice2 prompt fed one decoder layer per engine part under `[engine] max_step_ms` (issue 24, item 1).

On the full-size model on CPU a prompt's prefill (a few hundred positions through 24 layers) takes
0.5-0.7 s, several times the default budget. `SlotKV.forward_parts` computes `forward` layer by layer
(the same operations in the same order); the backend feeds a prompt that way while a budget is set and
no decode graphs are captured, and draws the first token as `decode_batch` would.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cv2_engine_helpers import GOLDEN_VOICE, build_speaking_model_dir, load_speaking_model, make_backend
from engine_helpers import EventLog, RecordingSink
from parts_helpers import one_second_clock

from voicertc.backends.cosyvoice.llm.kv import SlotKV
from voicertc.engine import Cancelled, Done
from voicertc.engine.work import Decode
from voicertc.engine.worker import EngineWorker

TEXT = "Zebras quietly jump over seven lazy dogs."


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory):
    torch.set_num_threads(2)
    return load_speaking_model(
        build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("prefill"))
    )


def test_forward_in_parts_equals_forward_even_when_the_pool_grows_between_parts(model):
    backbone = model.llm.llm.model.model
    hidden_size = backbone.config.hidden_size
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randn(1, 40, hidden_size, generator=generator)
    other = torch.randn(1, 70, hidden_size, generator=generator)

    whole_pool = SlotKV(backbone, slots=1, capacity=32)
    whole = whole_pool.acquire()
    expected = whole_pool.forward([whole], prompt)

    pool = SlotKV(backbone, slots=1, capacity=32)
    row = pool.acquire()
    parts = pool.forward_parts([row], prompt)
    next(parts)
    next(parts)
    grown = pool.acquire()  # a second slot: the pool doubles its slots and copies what was written
    pool.forward([grown], other)  # and its capacity, for 70 positions
    assert pool.grows >= 2 and row.length == 0  # the row's length moves at the end only
    with pytest.raises(StopIteration) as end:
        while True:
            next(parts)
    assert torch.equal(end.value.value, expected)
    assert row.length == whole.length == 40
    assert torch.equal(pool.k[:, row.index, :, :40], whole_pool.k[:, whole.index, :, :40])
    assert torch.equal(pool.v[:, row.index, :, :40], whole_pool.v[:, whole.index, :, :40])


def speak(backend):
    """One utterance; per engine unit: (work, decode batches run)."""
    units: list[tuple[object, int]] = []
    run = backend.run

    def recorded(batch, now_s):
        before = backend.stats["decode_batches"]
        results = run(batch, now_s)
        units.append((batch[0].work, backend.stats["decode_batches"] - before))
        return results

    backend.run = recorded
    engine = EngineWorker(backend, default_voice=GOLDEN_VOICE, name="cv2-prefill-parts")
    log, sink = EventLog(), RecordingSink()
    engine.start()
    try:
        uid = engine.open_utterance(GOLDEN_VOICE, sink, log, utterance_id="u")
        engine.push_text(uid, TEXT, end=True)
        log.wait_terminal([uid], timeout_s=300)
    finally:
        engine.stop()
    assert isinstance(log.of("u")[-1], Done), log.of("u")[-1]
    return sink.samples("u"), units


def test_a_prompt_fed_a_layer_per_unit_speaks_what_one_forward_speaks(model, golden_dir):
    layers = model.llm.llm.model.model.config.num_hidden_layers
    whole, whole_units = speak(make_backend(model, golden_dir))
    budgeted = make_backend(model, golden_dir, max_step_ms=1500, step_clock=one_second_clock())
    split, units = speak(budgeted)
    decodes = [n for work, n in units if isinstance(work, Decode)]
    # a segment's prompt: a unit per layer, then one for the final norm and the first token (no batched
    # decode in any of them); then one decode token per unit
    assert decodes[: layers + 1] == [0] * (layers + 1) and decodes[layers + 1] == 1
    assert max(decodes) == 1
    assert not any(n == 0 for work, n in whole_units if isinstance(work, Decode))
    assert whole.size > 0 and np.array_equal(split, whole)  # the same tokens, the same audio


def test_a_cancel_inside_a_prompt_frees_its_slot(model, golden_dir):
    backend = make_backend(model, golden_dir, max_step_ms=1500, step_clock=one_second_clock())
    engine = EngineWorker(backend, default_voice=GOLDEN_VOICE, name="cv2-prefill-cancel")
    run, log = backend.run, EventLog()
    seen: list[int] = []

    def cancel_mid_prompt(batch, now_s):
        results = run(batch, now_s)
        utt = backend._active.get("u")
        if utt is not None and utt.backend_state.prefill_parts is not None:
            seen.append(1)
            if len(seen) == 2:
                engine.cancel("u")
        return results

    backend.run = cancel_mid_prompt
    engine.start()
    try:
        engine.open_utterance(GOLDEN_VOICE, RecordingSink(), log, utterance_id="u")
        engine.push_text("u", TEXT, end=True)
        log.wait_terminal(["u"], timeout_s=300)
    finally:
        engine.stop()
    assert len(seen) >= 2 and isinstance(log.of("u")[-1], Cancelled)
    assert backend._active == {} and backend.kv.in_use == 0
