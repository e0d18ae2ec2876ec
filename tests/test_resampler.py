"""StreamingResampler: chunked == one-shot soxr, no clicks at joins, passthrough; fades."""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from voicertc.audio import StreamingResampler, fade_in, fade_out, fade_out_gain


def sine(freq_hz: float, rate_hz: int, seconds: float, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate_hz * seconds)) / rate_hz
    return (amp * np.sin(2 * np.pi * freq_hz * t)).astype(np.float32)


def resample_in_chunks(pcm: np.ndarray, rate_hz: int, rng: np.random.Generator) -> np.ndarray:
    resampler = StreamingResampler(rate_hz)
    out, pos = [], 0
    while pos < len(pcm):
        n = int(rng.integers(1, 2000))
        out.append(resampler.process(pcm[pos : pos + n]))
        pos += n
    out.append(resampler.flush())
    return np.concatenate(out)


@pytest.mark.parametrize("rate_hz", [22050, 24000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_equals_one_shot(rate_hz, seed):
    pcm = sine(440.0, rate_hz, 1.0)
    chunked = resample_in_chunks(pcm, rate_hz, np.random.default_rng(seed))
    one_shot = soxr.resample(pcm, rate_hz, 48000, quality="HQ")
    assert abs(len(chunked) - len(one_shot)) <= 1
    n = min(len(chunked), len(one_shot))
    np.testing.assert_allclose(chunked[:n], one_shot[:n], atol=1e-4)
    assert abs(len(chunked) - 48000) <= 2


@pytest.mark.parametrize("rate_hz", [22050, 24000])
def test_no_click_at_chunk_joins(rate_hz):
    freq_hz, amp = 440.0, 0.5
    chunked = resample_in_chunks(sine(freq_hz, rate_hz, 1.0, amp), rate_hz, np.random.default_rng(7))
    steady = chunked[2000:-2000]  # skip the filter's onset/offset transients
    max_step = 2 * np.pi * freq_hz / 48000 * amp  # steepest slope of the sine per output sample
    assert np.abs(np.diff(steady)).max() < 1.05 * max_step
    expected = sine(freq_hz, 48000, 1.0, amp)[2000 : 2000 + len(steady)]
    np.testing.assert_allclose(steady, expected, atol=2e-3)  # the right pitch and phase: no pitch shift


def test_passthrough_at_48k():
    resampler = StreamingResampler(48000)
    pcm = sine(1000.0, 48000, 0.1)
    assert resampler.passthrough
    np.testing.assert_array_equal(resampler.process(pcm), pcm)
    assert resampler.flush().size == 0


def test_process_after_flush_and_bad_shapes_raise():
    resampler = StreamingResampler(24000)
    resampler.flush()
    with pytest.raises(RuntimeError, match="after flush"):
        resampler.process(np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="mono"):
        StreamingResampler(24000).process(np.zeros((2, 10), np.float32))
    with pytest.raises(ValueError, match="rates"):
        StreamingResampler(0)


@pytest.mark.parametrize("shape", ["linear", "raised_cosine"])
def test_fade_gains_bounded_steps(shape):
    n = 480
    gain = fade_out_gain(n, shape)
    steps = np.abs(np.diff(np.concatenate([[1.0], gain, [0.0]])))
    bound = 1 / (n + 1) if shape == "linear" else np.pi / (2 * (n + 1))
    assert steps.max() <= bound + 1e-6
    assert np.all(np.diff(gain) < 0)


def test_fade_out_and_in_keep_dtype():
    pcm = np.full(100, 10000, np.int16)
    out = fade_out(pcm)
    assert out.dtype == np.int16 and out[0] > 9900 and out[-1] < 100
    rising = fade_in(np.ones(100, np.float32), "linear")
    assert rising.dtype == np.float32 and rising[0] < 0.02 and rising[-1] > 0.98
