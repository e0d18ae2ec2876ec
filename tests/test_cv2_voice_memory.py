"""Voices' prompt caches: built on first use, accounted in bytes, returned on DELETE (issue 24, item 3).

Start-up with N stored voices must not run the flow over N prompts (20 tiny voices took 5.5 min and
3.6 GB before); a deleted voice's flow K/V and LLM prefix must go with it.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from cv2_engine_helpers import build_speaking_model_dir, load_speaking_model, make_backend, tone_clip
from engine_helpers import EventLog, RecordingSink

from voicertc.backends.cosyvoice.voice.voice_caches import tensor_bytes
from voicertc.backends.cosyvoice.voice.voices import VoiceBook, VoiceStore
from voicertc.engine import Done
from voicertc.engine.worker import EngineWorker

torch.set_num_threads(1)

STORED = 4


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory):
    return load_speaking_model(
        build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("m"))
    )


@pytest.fixture(scope="module")
def voices_dir(model, tmp_path_factory):
    """STORED registered voices on disk, as a server that ran before left them."""
    directory = tmp_path_factory.mktemp("voices")
    book = VoiceBook(model, VoiceStore(directory))
    for i in range(STORED):
        book.register(tone_clip(3.0 + i, 150 + 20 * i), f"Voice number {i + 1}.", f"stored-{i}")
    return directory


class Counted:
    """Wraps a model method and counts its calls (the real method still runs)."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def test_start_up_does_no_per_voice_model_work(model, voices_dir, monkeypatch):
    init_stream = Counted(model.flow.init_stream_parts)
    prefix_cache = Counted(model.llm.prefix_cache_parts)
    monkeypatch.setattr(model.flow, "init_stream_parts", init_stream)
    monkeypatch.setattr(model.llm, "prefix_cache_parts", prefix_cache)
    VoiceBook(model, None)  # the model's own spk2info.pt voices (built in, few)
    built_in = init_stream.calls, prefix_cache.calls
    book = VoiceBook(model, VoiceStore(voices_dir))
    stored = [f"stored-{i}" for i in range(STORED)]
    assert set(stored) <= set(book.ids())
    assert (init_stream.calls, prefix_cache.calls) == (2 * built_in[0], 2 * built_in[1])  # none per stored
    assert all(book.get(v).prompt_tokens > 0 for v in stored)  # features are there, caches are not
    assert sum(book.get(v).caches.nbytes() for v in stored) == 0
    state = book.get("stored-2").flow_state  # first use builds that voice's caches only
    assert init_stream.calls == 2 * built_in[0] + 1 and state.frames > 0
    assert book.get("stored-2").caches.nbytes() > 0
    assert sum(book.get(v).caches.nbytes() for v in stored) == book.get("stored-2").caches.nbytes()
    assert book.get("stored-2").flow_state is state  # built once


def test_cache_accounting_counts_each_storage_once():
    base = torch.zeros(1000)
    assert tensor_bytes([base, base[:10], {"a": base.view(10, 100)}]) == 4000
    assert tensor_bytes([base, torch.zeros(10, dtype=torch.float64)]) == 4080


def test_a_deleted_voice_gives_its_prompt_caches_back(model, golden_dir, tmp_path):
    backend = make_backend(model, golden_dir, tmp_path / "voices", max_segment_tokens=30)
    engine = EngineWorker(backend, name="cv2-voice-memory")
    engine.start()
    try:
        for i, seconds in enumerate((3.0, 6.0)):
            engine.register_voice(
                tone_clip(seconds, 160 + 40 * i), f"Clip number {i + 1}.", f"v{i}", ""
            ).result(60)
            log = EventLog()
            uid = engine.open_utterance(f"v{i}", RecordingSink(), log)
            engine.push_text(uid, "Speak once.", end=True)
            log.wait_terminal([uid], 120)
            assert isinstance(log.of(uid)[-1], Done)
        book = backend.book
        sizes = {v: book.get(v).caches.nbytes() for v in ("v0", "v1")}
        assert sizes["v1"] > sizes["v0"] > 0  # a longer prompt holds more K/V
        before = book.cache_bytes()
        gone = weakref.ref(book.get("v1").flow_state)
        engine.delete_voice("v1").result(30)
        gc.collect()
        assert book.cache_bytes() == before - sizes["v1"]
        assert gone() is None  # nothing keeps the deleted voice's flow state alive
    finally:
        engine.stop()
