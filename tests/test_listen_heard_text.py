"""heard_text: backends mark the text of each step (SynthStep.text), the sink records where its audio
starts, and `heard_text(utterance, played_ms)` returns the chunks that had started playing."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from cv2_engine_helpers import GOLDEN_VOICE, build_speaking_model_dir, load_speaking_model, make_backend
from engine_helpers import EventLog, RecordingSink

from voicertc.audio import PcmRing, RingSink
from voicertc.engine.worker import EngineWorker


class MarkingSink(RecordingSink):
    """RecordingSink + text marks at the sample offset (source rate) where their audio starts."""

    def __init__(self) -> None:
        super().__init__()
        self.marks: list[tuple[int, str]] = []

    def mark_text(self, utterance_id: str, generation: int, text: str) -> None:
        self.marks.append((self.samples(utterance_id).size, text))


def say(backend, text: str, voice: str | None = None) -> MarkingSink:
    engine = EngineWorker(backend, default_voice=voice or "")
    sink, log = MarkingSink(), EventLog()
    engine.start()
    try:
        engine.open_utterance(voice, sink, log, utterance_id="u1")
        engine.push_text("u1", text, end=True)
        log.wait_terminal(["u1"], timeout_s=300)
    finally:
        engine.stop()
    return sink


def words(text: str) -> list[str]:
    return re.findall(r"\S+", text)


def test_ring_sink_heard_text_counts_chunks_that_started_playing():
    sink = RingSink(PcmRing(high_water_ms=4000), trim_leading_ms=0)
    one = np.full(4800, 0.1, np.float32)  # 100 ms at 48 kHz
    sink.mark_text("u", 0, "First clause,")
    sink.write(one, 48000, "u", 0)
    sink.write(one, 48000, "u", 0)
    sink.mark_text("u", 0, "then the rest.")
    sink.write(one, 48000, "u", 0)
    assert sink.heard_text("u", 0.0) == ""
    assert sink.heard_text("u", 50.0) == "First clause,"
    assert sink.heard_text("u", 199.0) == "First clause,"
    assert sink.heard_text("u", 201.0) == "First clause, then the rest."
    assert sink.heard_text("other", 500.0) == "" and sink.heard_text(None, 500.0) == ""
    sink.ring.clear()  # an interrupt: marks of the old generation are not added any more
    sink.mark_text("u", 0, "stale")
    assert "stale" not in sink.heard_text("u", 10_000.0)


def test_piper_marks_every_word_in_order_where_its_audio_starts():
    from voicertc.backends.piper import PiperBackend

    text = "Good morning, and welcome. The museum opens at nine, and closes at five in the evening."
    sink = say(PiperBackend(), text)
    offsets = [offset for offset, _ in sink.marks]
    assert offsets == sorted(offsets) and offsets[0] == 0 and len(offsets) >= 2
    assert words(" ".join(t for _, t in sink.marks)) == words(text)
    assert offsets[-1] < sink.samples("u1").size


def test_cosyvoice2_marks_its_text_segments(tiny_model_dir, golden_dir, tmp_path):
    torch.set_num_threads(2)
    model = load_speaking_model(build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path))
    backend = make_backend(model, golden_dir, max_segment_tokens=20)
    sink = say(backend, "Hello there. How are you today?", GOLDEN_VOICE)
    assert sink.marks and sink.marks[0][0] == 0
    joined = " ".join(t for _, t in sink.marks).lower()
    assert "hello" in joined and "today" in joined


@pytest.mark.parametrize("played_ms", [1.0, 10_000.0])
def test_fake_engine_heard_text_is_a_prefix(played_ms):
    from voicertc.config import FakeConfig
    from voicertc.engine.fake import FakeBackend

    text = "One sentence here. Another sentence there. And a third one to finish."
    sink = say(FakeBackend(FakeConfig(ttfa_ms=0, rtf=0.0)), text, "tone")
    heard = " ".join(t for offset, t in sink.marks if offset < played_ms * 24)
    assert heard and text.startswith(heard)
