"""`StreamSink`, the AudioSink of the speech endpoint and the TTS WebSocket: pacing model on an injected
clock, backpressure, cancel (stale generations), resampling and text marks. No engine."""

from __future__ import annotations

import asyncio

import numpy as np

from voicertc.streaming import StreamSink, TextMark


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def tone(seconds: float, rate_hz: int) -> np.ndarray:
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


async def test_queued_ms_is_audio_ahead_of_real_time_since_the_first_piece():
    clock = Clock()
    sink = StreamSink(asyncio.get_running_loop(), 24_000, clock=clock)
    assert sink.queued_ms == 0.0
    assert sink.write(tone(1.0, 24_000), 24_000, "u", sink.generation)
    assert sink.queued_ms == 1000.0
    clock.now_s += 0.4
    assert abs(sink.queued_ms - 600.0) < 1e-6
    clock.now_s += 2.0
    assert sink.queued_ms == 0.0  # behind real time: as urgent as an empty ring


async def test_backpressure_until_the_reader_takes_the_audio():
    sink = StreamSink(asyncio.get_running_loop(), 24_000, max_buffer_ms=500.0)
    woken: list[bool] = []
    sink.set_space_listener(lambda: woken.append(True))
    sink.write(tone(0.3, 24_000), 24_000, "u", sink.generation)
    assert sink.has_room() and not woken
    sink.write(tone(0.3, 24_000), 24_000, "u", sink.generation)
    assert not sink.has_room()
    await asyncio.wait_for(sink.arrived.wait(), 1.0)
    data, ended = sink.read()
    assert len(data) == 2 * int(0.6 * 24_000) and not ended
    assert sink.has_room() and woken == [True]  # the engine is woken once, when room came back


async def test_a_cleared_sink_refuses_stale_writes_and_drops_what_was_queued():
    sink = StreamSink(asyncio.get_running_loop(), 24_000)
    generation = sink.generation
    sink.write(tone(0.2, 24_000), 24_000, "u", generation)
    sink.clear()
    assert sink.read() == (b"", False)
    assert not sink.write(tone(0.2, 24_000), 24_000, "u", generation)
    sink.end_utterance("u", generation)  # stale: no end mark either
    assert sink.read() == (b"", False)


async def test_resampled_to_the_asked_rate_with_the_filter_tail_and_marks_in_place():
    sink = StreamSink(asyncio.get_running_loop(), 16_000)
    generation = sink.generation
    sink.mark_text("u", generation, "Hello there.")
    for _ in range(5):  # 1 s of 22.05 kHz in 5 pieces
        sink.write(tone(0.2, 22_050), 22_050, "u", generation)
    sink.mark_text("u", generation, "How are you?")
    sink.write(tone(0.5, 22_050), 22_050, "u", generation)
    sink.end_utterance("u", generation)
    data, ended = sink.read()
    assert ended
    samples = len(data) // 2
    assert abs(samples - 1.5 * 16_000) <= 2, samples  # chunked == one-shot length, tail flushed
    marks = sink.take_marks()
    assert [m.text for m in marks] == ["Hello there.", "How are you?"]
    assert marks[0] == TextMark("Hello there.", 0.0)
    assert abs(marks[1].audio_ms - 1000.0) < 1e-6  # where the second text's audio starts
    assert sink.take_marks() == []
