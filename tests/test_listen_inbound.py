"""The inbound side of a call's microphone: 16 kHz conversion and the bounded per-reader buffer."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from voicertc.listen.inbound import InboundBuffer, InboundConverter, to_16k_mono


def frame(n: int = 320, value: int = 1) -> np.ndarray:
    return np.full(n, value, dtype=np.int16)


def test_buffer_drops_oldest_and_counts():
    buffer = InboundBuffer(max_ms=100)  # 1600 samples = 5 frames of 320
    for i in range(8):
        buffer.push(frame(value=i))
    assert buffer.queued_samples == 1600
    assert buffer.dropped_frames == 3 and buffer.dropped_samples == 960
    assert [int(buffer.pop()[0]) for _ in range(5)] == [3, 4, 5, 6, 7]
    assert buffer.pop() is None


def test_buffer_never_exceeds_its_bound_even_for_a_huge_frame():
    buffer = InboundBuffer(max_ms=20)
    buffer.push(frame(320, 1))
    buffer.push(frame(1000, 2))
    assert buffer.queued_samples <= buffer.max_samples == 320
    assert buffer.dropped_frames == 1


async def test_get_waits_for_a_frame_and_close_ends_it():
    buffer = InboundBuffer(max_ms=1000)
    waiter = asyncio.ensure_future(buffer.get())
    await asyncio.sleep(0)
    assert not waiter.done()
    buffer.push(frame(value=7))
    assert int((await waiter)[0]) == 7
    closing = asyncio.ensure_future(buffer.get())
    await asyncio.sleep(0)
    buffer.close()
    assert await closing is None
    assert buffer.push(frame()) == 0 and buffer.pop() is None  # closed: nothing is queued any more


def test_bad_bound_is_refused():
    with pytest.raises(ValueError):
        InboundBuffer(max_ms=0)


def test_stereo_is_averaged_to_mono():
    interleaved = np.array([[1000, 3000, -2000, 0]], dtype=np.int16)
    mono = to_16k_mono(interleaved, channels=2)
    np.testing.assert_allclose(mono * 32768.0, [2000.0, -1000.0])


def test_48k_stereo_frames_become_16k_mono_with_the_tone_kept():
    converter = InboundConverter()
    t = np.arange(48000) / 48000.0
    tone = (0.5 * np.sin(2 * np.pi * 440.0 * t) * 32767).astype(np.int16)
    stereo = np.repeat(tone, 2)  # interleaved L/R, as aiortc's Opus decoder hands them
    out = np.concatenate(
        [converter.convert(stereo[i : i + 1920], 48000, 2) for i in range(0, stereo.size, 1920)]
    )
    assert out.dtype == np.int16
    assert abs(out.size - 16000) <= 160  # the resampler holds back a few ms, never more
    spectrum = np.abs(np.fft.rfft(out[2000:14000].astype(np.float64)))
    peak_hz = np.argmax(spectrum) * 16000 / 12000
    assert abs(peak_hz - 440.0) < 5.0
    assert 0.3 < np.abs(out[2000:14000]).max() / 32767 < 0.6


def test_16k_input_passes_through():
    converter = InboundConverter()
    pcm = np.arange(320, dtype=np.int16)
    np.testing.assert_array_equal(converter.convert(pcm, 16000, 1), pcm)
