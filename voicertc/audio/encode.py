"""Streaming encoders for PCM16 mono: raw pcm, wav with a streamable header, and Ogg Opus, mp3, flac
and aac (ADTS) through PyAV. `encode(pcm)` returns the bytes the container has ready now (possibly
none), `finish()` the rest; so a response can send audio as it is synthesized. Runs on the event loop
(encoding 24 kHz mono costs well under a millisecond per 100 ms of audio).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import av
import numpy as np

STREAMING_SIZE = 0xFFFFFFFF  # RIFF/data size of a WAV whose length is unknown when the header leaves


class StreamEncoder(Protocol):
    content_type: str

    def encode(self, pcm: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


class PcmEncoder:
    """Raw PCM16 LE: the bytes as they are."""

    content_type = "audio/pcm"

    def __init__(self, sample_rate_hz: int) -> None:
        self.sample_rate_hz = sample_rate_hz

    def encode(self, pcm: bytes) -> bytes:
        return pcm

    def finish(self) -> bytes:
        return b""


class WavEncoder:
    """PCM16 WAV: a header whose sizes say "unknown" (0xFFFFFFFF, what streaming servers send), then
    the samples; decoders read to the end of the stream."""

    content_type = "audio/wav"

    def __init__(self, sample_rate_hz: int) -> None:
        self.sample_rate_hz = sample_rate_hz
        self._header_sent = False

    def header(self) -> bytes:
        rate = self.sample_rate_hz
        fmt = struct.pack("<HHIIHH", 1, 1, rate, 2 * rate, 2, 16)
        return (
            b"RIFF" + struct.pack("<I", STREAMING_SIZE) + b"WAVE"
            + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + b"data" + struct.pack("<I", STREAMING_SIZE)
        )  # fmt: skip

    def encode(self, pcm: bytes) -> bytes:
        if self._header_sent:
            return pcm
        self._header_sent = True
        return self.header() + pcm

    def finish(self) -> bytes:
        return b"" if self._header_sent else self.encode(b"")


class _Collector:
    """The file object PyAV muxes into: collects what it writes; not seekable (a stream)."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def write(self, data: Any) -> int:
        self.pieces.append(bytes(data))
        return len(data)

    def seekable(self) -> bool:
        return False

    def take(self) -> bytes:
        data = b"".join(self.pieces)
        self.pieces.clear()
        return data


@dataclass(frozen=True)
class _Container:
    content_type: str
    muxer: str
    codec: str
    rates_hz: tuple[int, ...] = ()  # the codec's rates; others are resampled by PyAV to the first one
    options: tuple[tuple[str, str], ...] = ()


class AvEncoder:
    """A PyAV container written as a stream (`_Collector`), fed PCM16 mono at `sample_rate_hz`."""

    def __init__(self, spec: _Container, sample_rate_hz: int) -> None:
        self.content_type = spec.content_type
        self.sample_rate_hz = sample_rate_hz
        self._out = _Collector()
        self._container = av.open(self._out, mode="w", format=spec.muxer, options=dict(spec.options))
        rate = sample_rate_hz if not spec.rates_hz or sample_rate_hz in spec.rates_hz else spec.rates_hz[0]
        self._stream: Any = self._container.add_stream(spec.codec, rate=rate, layout="mono")
        self._pts = 0
        self._finished = False

    def encode(self, pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, dtype="<i2")
        if samples.size:
            frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = self.sample_rate_hz
            frame.pts = self._pts
            self._pts += samples.size
            self._container.mux(self._stream.encode(frame))
        return self._out.take()

    def finish(self) -> bytes:
        if not self._finished:
            self._finished = True
            self._container.mux(self._stream.encode(None))
            self._container.close()
        return self._out.take()


_CONTAINERS = {
    # Ogg pages every 20 ms (the muxer's default holds a page for 1 s): audio leaves as it is made
    "opus": _Container(
        "audio/ogg", "ogg", "libopus", (48_000, 24_000, 16_000, 12_000, 8_000), (("page_duration", "20000"),)
    ),
    "mp3": _Container("audio/mpeg", "mp3", "libmp3lame", (24_000, 22_050, 16_000, 48_000, 44_100)),
    "flac": _Container("audio/flac", "flac", "flac"),
    "aac": _Container("audio/aac", "adts", "aac"),
}

_RAW: dict[str, Callable[[int], StreamEncoder]] = {"pcm": PcmEncoder, "wav": WavEncoder}
FORMATS = (*_RAW, *_CONTAINERS)  # the `response_format` values


def encoder_for(response_format: str, sample_rate_hz: int) -> StreamEncoder:
    """A fresh encoder for one response; KeyError for a format not in `FORMATS`."""
    if response_format in _CONTAINERS:
        return AvEncoder(_CONTAINERS[response_format], sample_rate_hz)
    return _RAW[response_format](sample_rate_hz)
