"""Prompt clips for voice-registration tests, encoded for real with PyAV (wav, flac, ogg/opus, mp3)."""

from __future__ import annotations

import io

import av
import numpy as np

FORMATS = {  # name -> (container, codec, sample rate)
    "wav": ("wav", "pcm_s16le", 16000),
    "flac": ("flac", "flac", 22050),
    "opus": ("ogg", "libopus", 48000),
    "mp3": ("mp3", "libmp3lame", 24000),
}


def voiced(seconds: float, rate_hz: int, amplitude: float = 0.3) -> np.ndarray:
    """A voiced-sounding tone (180 Hz with a 3 Hz tremolo), float32 mono."""
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    return (amplitude * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(
        np.float32
    )


def encode(samples: np.ndarray, rate_hz: int, fmt: str = "wav") -> bytes:
    """`samples` (float32 mono at `rate_hz`) as a file of format `fmt` (a FORMATS key)."""
    container_name, codec, codec_rate = FORMATS[fmt]
    if codec_rate != rate_hz:
        n = int(len(samples) * codec_rate / rate_hz)
        samples = np.interp(np.arange(n) * rate_hz / codec_rate, np.arange(len(samples)), samples).astype(
            np.float32
        )
    out = io.BytesIO()
    with av.open(out, mode="w", format=container_name) as container:
        stream = container.add_stream(codec, rate=codec_rate, layout="mono")
        pcm = (np.clip(samples, -1, 1) * 32767).astype(np.int16)
        fmt_name = "s16" if codec in ("pcm_s16le", "flac") else "flt"
        data = pcm if fmt_name == "s16" else samples.astype(np.float32)
        frame_len = 960 if codec == "libopus" else 1152 if codec == "libmp3lame" else 4096
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="mono", rate=codec_rate)
        pts = 0
        for start in range(0, len(data), frame_len):
            piece = data[start : start + frame_len]
            frame = av.AudioFrame.from_ndarray(piece[None], format=fmt_name, layout="mono")
            frame.sample_rate = codec_rate
            frame.pts = pts
            pts += len(piece)
            for converted in resampler.resample(frame):
                for packet in stream.encode(converted):
                    container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def clip(fmt: str = "wav", seconds: float = 2.0, amplitude: float = 0.3) -> bytes:
    return encode(voiced(seconds, 16000, amplitude), 16000, fmt)
