"""Prompt-clip decoding is bounded by `[limits] voice_max_s`, whatever the file says or hides: the
container's duration is probed before decoding, and decoding stops the moment it passes the limit."""

from __future__ import annotations

import io
import tracemalloc

import av
import numpy as np
import pytest
from audio_clips import clip

from voicertc.audio.decode import AudioError, ClipLimits, decode_audio, load_clip

RATE_HZ = 8000
LIMITS = ClipLimits(min_s=1.0, max_s=30.0, max_bytes=10 * 1024 * 1024)


def silent_flac(seconds: int) -> bytes:
    """`seconds` of digital silence as FLAC: a few hundred KB per hour (a decompression bomb)."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="flac") as container:
        stream = container.add_stream("flac", rate=RATE_HZ, layout="mono")
        block = np.zeros((1, RATE_HZ * 10), np.int16)
        for _ in range(seconds // 10):
            frame = av.AudioFrame.from_ndarray(block, format="s16", layout="mono")
            frame.sample_rate = RATE_HZ
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def without_length(flac: bytes) -> bytes:
    """The same FLAC with STREAMINFO's total-samples field zeroed ("unknown"), as an encoder may write it."""
    assert flac[:4] == b"fLaC"
    data = bytearray(flac)
    info = 8  # "fLaC" + the metadata block header
    data[info + 13] &= 0xF0  # the top 4 of the 36 bits of total samples
    data[info + 14 : info + 18] = b"\0\0\0\0"
    return bytes(data)


@pytest.fixture(scope="module")
def hour_flac() -> bytes:
    return silent_flac(3600)


def decode_peak_mb(data: bytes) -> tuple[AudioError, float]:
    """The refusal and the peak of Python-visible allocations (numpy arrays included) while decoding."""
    tracemalloc.start()
    try:
        with pytest.raises(AudioError) as refused:
            load_clip(data, LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return refused.value, peak / 1e6


def test_an_hour_of_flac_is_refused_by_its_header_before_decoding(hour_flac):
    assert len(hour_flac) < LIMITS.max_bytes  # the bomb fits under voice_max_bytes
    error, peak_mb = decode_peak_mb(hour_flac)
    assert error.code == "audio_too_long" and "3600" in str(error), error
    assert peak_mb < 5, peak_mb  # nothing decoded (one hour at 8 kHz float32 would be 115 MB)


def test_an_hour_with_no_length_in_its_header_stops_decoding_at_the_limit(hour_flac):
    hidden = without_length(hour_flac)
    with av.open(io.BytesIO(hidden)) as container:  # the probe has nothing to go on
        stream = container.streams.audio[0]
        assert not stream.duration or float(stream.duration * stream.time_base) < 3600
    error, peak_mb = decode_peak_mb(hidden)
    assert error.code == "audio_too_long" and "decoding passed" in str(error), error
    assert peak_mb < 50, peak_mb  # at most ~30 s of samples were kept


def test_the_limit_is_the_configured_one_and_clips_inside_it_decode_whole():
    data = clip("flac", seconds=5.0)
    decoded = decode_audio(data, max_s=6.0)
    assert decoded.seconds == pytest.approx(5.0, abs=0.05)
    with pytest.raises(AudioError) as refused:
        decode_audio(data, max_s=3.0)
    assert refused.value.code == "audio_too_long"
    assert load_clip(data, LIMITS).seconds == pytest.approx(5.0, abs=0.05)
