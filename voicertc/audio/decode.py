"""Prompt clips for voice registration: any common container (wav, flac, ogg/opus, mp3, webm) decoded
with PyAV into mono float32, then checked against the `[limits] voice_*` bounds.

Runs on whatever thread calls it (the HTTP handler runs it in a worker thread, never on the loop).
Every refusal is an `AudioError` whose `code` names the problem and `status` is the HTTP status.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from voicertc.errors import InputError

logger = logging.getLogger(__name__)

SILENCE_DBFS = -50.0  # a clip whose loudest 50 ms window is quieter than this is "silent"
WINDOW_S = 0.05
PROBE_SLACK_S = 0.5  # container durations round up (a last partial frame, priming samples)


class AudioError(InputError):
    """A prompt clip that cannot be used; `code` and `status` name the problem for the HTTP answer."""

    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


@dataclass(frozen=True)
class ClipLimits:
    min_s: float = 1.0
    max_s: float = 30.0
    max_bytes: int = 10 * 1024 * 1024


@dataclass(frozen=True)
class Clip:
    """Mono float32 samples in [-1, 1] at `sample_rate_hz`."""

    samples: np.ndarray
    sample_rate_hz: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate_hz if self.sample_rate_hz else 0.0


def decode_audio(data: bytes, max_s: float | None = None) -> Clip:
    """Decode the first audio stream of `data` (any container PyAV/FFmpeg reads) to mono float32.

    With `max_s`, a file is refused `audio_too_long` before it is decoded when its container says it
    is longer (the probe), and while it is decoded the moment its samples pass `max_s` (the container
    may lie or not know): a small file of hours of silence costs at most `max_s` of samples.
    """
    import av

    if not data:
        raise AudioError("audio_undecodable", "the audio file is empty")
    pieces: list[np.ndarray] = []
    rate_hz = 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise AudioError("audio_undecodable", "the file has no audio stream")
            stream = container.streams.audio[0]
            if max_s is not None:
                _refuse_if_longer(probe_seconds(container, stream), max_s, "the file says it is")
            resampler = av.AudioResampler(format="flt", layout="mono")
            decoded = 0  # input samples, at the stream's rate
            for frame in container.decode(stream):
                rate_hz = rate_hz or int(frame.sample_rate)
                decoded += int(frame.samples)
                if max_s is not None and rate_hz:
                    _refuse_if_longer(decoded / rate_hz, max_s, "decoding passed")
                for out in resampler.resample(frame):
                    pieces.append(out.to_ndarray().reshape(-1))
            for out in resampler.resample(None):
                pieces.append(out.to_ndarray().reshape(-1))
    except AudioError:
        raise
    except Exception as exc:  # av.error.* (InvalidDataError, ...), ValueError on odd headers
        raise AudioError(
            "audio_undecodable", f"the audio cannot be decoded ({type(exc).__name__}: {exc})"
        ) from exc
    samples = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
    if not rate_hz or not samples.size:
        raise AudioError("audio_undecodable", "the file holds no audio samples")
    return Clip(np.clip(samples, -1.0, 1.0), rate_hz)


def probe_seconds(container: Any, stream: Any) -> float:
    """The longest duration the container or the stream header states, without decoding (0 = unknown)."""
    known = [0.0]
    if container.duration:  # in AV_TIME_BASE units (microseconds)
        known.append(float(container.duration) / 1_000_000)
    if stream.duration and stream.time_base:
        known.append(float(stream.duration * stream.time_base))
    return max(known)


def _refuse_if_longer(seconds: float, max_s: float, how: str) -> None:
    if seconds > max_s + PROBE_SLACK_S:
        raise AudioError(
            "audio_too_long", f"{how} {seconds:.1f} s of audio; the limit is {max_s:g} s (limits.voice_max_s)"
        )


def peak_dbfs(clip: Clip) -> float:
    """Loudness of the loudest 50 ms window (RMS, dBFS)."""
    window = max(1, int(WINDOW_S * clip.sample_rate_hz))
    usable = len(clip.samples) // window * window
    if usable == 0:
        return -np.inf
    rms = np.sqrt(np.mean(clip.samples[:usable].reshape(-1, window) ** 2, axis=1)).max()
    return float(20 * np.log10(rms)) if rms > 0 else -np.inf


def check_clip(clip: Clip, limits: ClipLimits) -> Clip:
    """Refuse clips that are too short, too long or silent (AudioError with a code)."""
    if clip.seconds < limits.min_s:
        raise AudioError(
            "audio_too_short",
            f"the clip is {clip.seconds:.2f} s; at least {limits.min_s:g} s of speech is needed",
        )
    if clip.seconds > limits.max_s:
        raise AudioError(
            "audio_too_long", f"the clip is {clip.seconds:.1f} s; the limit is {limits.max_s:g} s"
        )
    loudest = peak_dbfs(clip)
    if loudest < SILENCE_DBFS:
        raise AudioError(
            "audio_silent",
            f"the clip is silent (loudest 50 ms at {loudest:.0f} dBFS, below {SILENCE_DBFS:g})",
        )
    return clip


def load_clip(data: bytes, limits: ClipLimits) -> Clip:
    """Size check, decode, duration and silence checks: a clip fit to become a voice prompt."""
    if len(data) > limits.max_bytes:
        raise AudioError(
            "audio_too_large", f"the file is {len(data)} bytes; the limit is {limits.max_bytes}", status=413
        )
    return check_clip(decode_audio(data, limits.max_s), limits)
