"""Delivery: the outlet the engine worker and the remote client share (hold, write with room, TTFA, clear)."""

from __future__ import annotations

import numpy as np
from engine_helpers import RecordingSink

from voicertc.engine.delivery import Delivery, Wrote
from voicertc.engine.protocol import FirstAudio


class MarkSink(RecordingSink):
    def __init__(self, room_samples: int | None = None) -> None:
        super().__init__(room_samples)
        self.log: list[object] = []

    def write(self, pcm, sample_rate_hz, utterance_id, generation) -> bool:
        ok = super().write(pcm, sample_rate_hz, utterance_id, generation)
        if ok:
            self.log.append(len(pcm))
        return ok

    def mark_text(self, utterance_id, generation, text) -> None:
        self.log.append(text)


class Clock:
    def __init__(self, now_s: float = 0.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def make(sink: RecordingSink, opened_s: float = 1.0) -> Delivery:
    return Delivery(utterance_id="u1", sink=sink, generation=0, opened_s=opened_s)


def test_pieces_and_marks_are_written_in_order_and_the_first_is_first_audio():
    sink, clock, events = MarkSink(), Clock(), []
    d = make(sink)
    d.note_text("   ", 1.5)  # blank text does not start the clock
    d.note_text("Hello", 2.0)
    d.hold_mark("Hello")
    d.hold(np.zeros(240, np.float32), 24000)
    d.hold(np.zeros(480, np.float32), 24000)
    clock.now_s = 2.25
    assert d.write(events.append, clock) is Wrote.ALL
    assert sink.log == ["Hello", 240, 480]
    assert events == [FirstAudio("u1", ttfa_ms=250.0)]
    assert d.written_ms == 30.0 and d.written_samples == 720 and not d.held
    d.hold(np.zeros(240, np.float32), 24000)
    assert d.write(events.append, clock) is Wrote.ALL and len(events) == 1  # first audio once


def test_ttfa_counts_from_the_open_when_the_text_came_with_it():
    sink, events = MarkSink(), []
    d = make(sink, opened_s=5.0)
    d.hold(np.zeros(10, np.float32), 16000)
    d.write(events.append, Clock(5.5))
    assert d.ttfa_s == 0.5 and events[0].ttfa_ms == 500.0


def test_a_full_sink_keeps_the_rest_until_it_has_room():
    sink, events = MarkSink(room_samples=300), []
    d = make(sink)
    for _ in range(3):
        d.hold(np.zeros(200, np.float32), 24000)
    assert d.write(events.append, Clock()) is Wrote.FULL
    assert sink.log == [200, 200] and len(d.held) == 1
    sink.room_samples = None
    assert d.write(events.append, Clock()) is Wrote.ALL and not d.held


def test_a_cleared_sink_reports_cleared_and_abort_frees_it():
    sink, events = MarkSink(), []
    d = make(sink)
    d.hold(np.zeros(200, np.float32), 24000)
    d.hold(np.zeros(200, np.float32), 24000)
    sink.generation = 1  # an interrupt cleared the sink
    assert d.write(events.append, Clock()) is Wrote.CLEARED
    assert events == [] and d.first_audio_s is None
    d.abort()
    assert not d.held and sink.aborted == ["u1"]


def test_end_marks_the_end_for_playback():
    sink = MarkSink()
    d = make(sink)
    d.end()
    assert sink.ended == ["u1"]
