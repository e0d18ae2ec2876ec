"""The bundled Piper voice behind the engine protocol (real onnxruntime, offline)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import EventLog, RecordingSink

from voicertc.backends.piper import PiperBackend
from voicertc.engine import Done, Failed, FirstAudio
from voicertc.engine.worker import EngineWorker
from voicertc.errors import ModelDirError


@pytest.fixture(scope="module")
def piper_engine():
    eng = EngineWorker(PiperBackend(threads=1))
    eng.start()
    yield eng
    eng.stop()


def test_sentence_is_spoken_at_22050_hz_in_growing_chunks(piper_engine):
    log, sink = EventLog(), RecordingSink()
    writes: list[int] = []
    original = sink.write

    def spy(pcm, rate, uid, gen):
        writes.append(len(pcm))
        return original(pcm, rate, uid, gen)

    sink.write = spy  # every piece the engine writes is at most 100 ms
    text = "Hello, this is a real time voice test. The quick brown fox jumps over the lazy dog."
    uid = piper_engine.say(None, sink, log, text)
    log.wait_terminal([uid], timeout_s=60)
    assert [type(e) for e in log.of(uid)] == [FirstAudio, Done]
    assert sink.rates == {22050}
    pcm = sink.samples(uid)
    assert 3.0 < len(pcm) / 22050 < 9.0
    assert np.abs(pcm).max() < 1.0 and pcm.std() > 0.02
    done = log.of(uid)[-1]
    assert done.metrics["rtf"] > 0
    assert writes and max(writes) <= 2205 and sum(writes) == len(pcm)


def test_first_chunk_is_a_short_clause_and_later_chunks_grow(piper_engine):
    backend = piper_engine.backend
    spoken: list[str] = []
    original = backend.pieces
    backend.pieces = lambda text, first=False: spoken.append(text) or original(text, first=first)
    try:
        log, sink = EventLog(), RecordingSink()
        sentences = [f"This is sentence number {n}, which has a handful of words." for n in range(12)]
        uid = piper_engine.say(None, sink, log, "Sure, here is the thing. " + " ".join(sentences))
        log.wait_terminal([uid], timeout_s=120)
    finally:
        backend.pieces = original
    assert spoken[0] == "Sure, here is the thing."
    sizes = [len(text) for text in spoken]
    assert all(size <= backend.chunk_limit_chars(i) for i, size in enumerate(sizes))
    assert max(sizes[3:]) > 2 * sizes[1] > 0  # later chunks are bigger: whole sentences, merged
    assert " ".join(spoken).split() == ("Sure, here is the thing. " + " ".join(sentences)).split()


def test_punctuation_only_gives_done_without_audio(piper_engine):
    log, sink = EventLog(), RecordingSink()
    uid = piper_engine.say(None, sink, log, "... !? \U0001f600")
    log.wait_terminal([uid], timeout_s=30)
    assert [type(e) for e in log.of(uid)] == [Done]
    assert len(sink.samples(uid)) == 0


def test_empty_text_fails(piper_engine):
    log, sink = EventLog(), RecordingSink()
    uid = piper_engine.say(None, sink, log, "")
    log.wait_terminal([uid])
    assert isinstance(log.of(uid)[0], Failed)


def test_missing_voice_file_names_it(tmp_path):
    with pytest.raises(ModelDirError, match="nope.onnx"):
        PiperBackend(tmp_path / "nope.onnx")
