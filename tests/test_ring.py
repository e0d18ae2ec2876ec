"""PcmRing: wraparound, overfill, generations, high-water + space listener, utterance marks, threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from voicertc.audio import PcmRing, RingOverflowError, RingSink, Span


def ramp(start: int, n: int) -> np.ndarray:
    return ((np.arange(start, start + n) % 65536) - 32768).astype(np.int16)


def small_ring(high_water_ms: float = 10.0, margin_ms: float = 5.0) -> PcmRing:
    return PcmRing(high_water_ms=high_water_ms, margin_ms=margin_ms)  # 480 + 240 samples


def test_sizes_and_queued_ms():
    ring = small_ring()
    assert ring.high_water_samples == 480
    assert ring.capacity_samples == 720
    assert ring.write(ramp(0, 96), "u", 0)
    assert ring.queued_samples == 96
    assert ring.queued_ms == pytest.approx(2.0)


def test_wraparound_keeps_order():
    ring = small_ring()
    written = read = 0
    out = []
    for step in range(40):  # many passes over the 720-sample array with odd sizes
        n = 97 + step % 13
        assert ring.write(ramp(written, n), "u", 0)
        written += n
        got = ring.read(n + (step % 3) - 1).pcm
        read += len(got)
        out.append(got)
    out.append(ring.read(10_000).pcm)
    np.testing.assert_array_equal(np.concatenate(out), ramp(0, written))


def test_overfill_raises_and_keeps_content():
    ring = small_ring()
    assert ring.write(ramp(0, 700), "u", 0)
    with pytest.raises(RingOverflowError, match="overflow"):
        ring.write(ramp(700, 21), "u", 0)
    assert ring.queued_samples == 700
    np.testing.assert_array_equal(ring.read(1000).pcm, ramp(0, 700))


def test_write_rejects_wrong_dtype():
    with pytest.raises(ValueError, match="int16"):
        small_ring().write(np.zeros(10, np.float32), "u", 0)


def test_clear_bumps_generation_and_drops_late_writes():
    ring = small_ring()
    ring.write(ramp(0, 300), "a", 0)
    head = ring.clear(head_samples=50)
    np.testing.assert_array_equal(head.pcm, ramp(0, 50))
    assert head.spans == (Span("a", 50, False),)
    assert ring.generation == 1
    assert ring.queued_samples == 0
    assert not ring.write(ramp(0, 10), "a", 0)  # late piece of the cancelled utterance
    assert not ring.end_utterance("a", 0)
    assert ring.queued_samples == 0
    assert ring.read(100).spans == ()
    assert ring.write(ramp(0, 10), "b", 1)
    assert ring.read(100).spans == (Span("b", 10, False),)


def test_high_water_and_space_listener():
    ring = small_ring()
    calls = []
    ring.set_space_listener(lambda: calls.append(ring.queued_samples))
    ring.write(ramp(0, 400), "u", 0)
    assert ring.has_room()
    ring.read(100)
    assert calls == []  # never was full: no wake-up needed
    ring.write(ramp(0, 200), "u", 0)  # 500 >= 480
    assert not ring.has_room()
    ring.read(10)  # 490: still full
    assert calls == []
    ring.read(20)  # 470: room again
    assert calls == [470]
    ring.read(20)
    assert calls == [470]  # once per crossing
    ring.write(ramp(0, 100), "u", 0)  # 550: full again
    ring.clear()
    assert calls == [470, 0]


@pytest.mark.expected_errors("ZeroDivisionError")
def test_space_listener_errors_do_not_escape():
    ring = small_ring()
    ring.set_space_listener(lambda: 1 / 0)
    ring.write(ramp(0, 500), "u", 0)
    assert len(ring.read(100).pcm) == 100


def test_utterance_marks_in_order():
    ring = small_ring()
    ring.write(ramp(0, 100), "a", 0)
    ring.write(ramp(100, 50), "a", 0)
    ring.end_utterance("a", 0)
    ring.write(ramp(150, 80), "b", 0)
    r = ring.read(120)
    assert r.spans == (Span("a", 120, False),)
    r = ring.read(100)
    assert r.spans == (Span("a", 30, True), Span("b", 70, False))
    r = ring.read(100)
    assert r.spans == (Span("b", 10, False),)
    r = ring.read(100)  # drained exactly, end mark of b not queued yet
    assert r.spans == () and len(r.pcm) == 0
    ring.end_utterance("b", 0)
    assert ring.read(100).spans == (Span("b", 0, True),)
    assert ring.read(100).spans == ()


def test_end_mark_without_audio_and_interleaved_writes():
    ring = small_ring()
    ring.end_utterance("empty", 0)
    ring.write(ramp(0, 10), "a", 0)
    ring.write(ramp(10, 10), "b", 0)
    ring.write(ramp(20, 10), "a", 0)
    ring.end_utterance("a", 0)
    r = ring.read(100)
    assert r.spans == (Span("empty", 0, True), Span("a", 10), Span("b", 10), Span("a", 10, True))


def run_threads(chunks: list[int], read_sizes: list[int], total: int) -> np.ndarray:
    ring = PcmRing(high_water_ms=20.0, margin_ms=10.0)  # 960 + 480 samples
    room = threading.Event()
    ring.set_space_listener(room.set)
    out: list[np.ndarray] = []

    def writer() -> None:
        written, i = 0, 0
        while written < total:
            while not ring.has_room():
                room.wait(0.01)
                room.clear()
            n = min(chunks[i % len(chunks)], total - written)
            assert ring.write(ramp(written, n), "u", 0)
            written += n
            i += 1
        ring.end_utterance("u", 0)

    thread = threading.Thread(target=writer)
    thread.start()
    ended, i = False, 0
    while not ended:
        r = ring.read(read_sizes[i % len(read_sizes)])
        out.append(r.pcm)
        ended = any(s.ended for s in r.spans)
        i += 1
    thread.join(5)
    return np.concatenate(out)


@settings(max_examples=15, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 480), min_size=1, max_size=8),
    read_sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=8),
)
def test_two_threads_every_sample_once_in_order(chunks, read_sizes):
    total = 48_000
    np.testing.assert_array_equal(run_threads(chunks, read_sizes, total), ramp(0, total))


def test_ring_sink_drops_stale_generation_and_marks_end():
    ring = small_ring(high_water_ms=200.0, margin_ms=50.0)
    sink = RingSink(ring)
    gen = sink.generation
    assert sink.write(np.full(480, 0.5, np.float32), 48000, "a", gen)
    np.testing.assert_array_equal(ring.read(480).pcm, np.full(480, 16384, np.int16))
    ring.clear()
    assert not sink.write(np.full(480, 0.5, np.float32), 48000, "a", gen)
    sink.end_utterance("a", gen)
    assert ring.queued_samples == 0 and ring.read(10).spans == ()
    assert sink.write(np.full(240, 2.0, np.float32), 24000, "b", sink.generation)  # clipped, resampled
    sink.end_utterance("b", sink.generation)
    r = ring.read(10_000)
    assert abs(len(r.pcm) - 480) <= 2
    assert r.spans[-1] == Span("b", len(r.pcm), True)
    assert r.pcm.max() <= 32767 and r.pcm[100:300].min() > 32000
