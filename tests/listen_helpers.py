"""Caller clips for the listening tests, synthesized at test time by the bundled Piper voice.

A clip is a list of parts: text (spoken) or a float (seconds of silence). `caller_clip` returns the
16 kHz float PCM and the speech edges of every spoken part (first/last sample above -40 dBFS in
10 ms frames), so tests can check events against the clip's own timeline.
"""

from __future__ import annotations

import functools
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soxr

CLIP_RATE_HZ = 16000
EDGE_DBFS = -40.0


@functools.cache
def _piper():
    from voicertc.backends.piper import PiperBackend

    return PiperBackend()


@functools.cache
def say(text: str) -> np.ndarray:
    """`text` spoken by the bundled voice, 16 kHz float32."""
    piper = _piper()
    pcm = np.concatenate(piper.synthesize(text)).astype(np.float32)
    return soxr.resample(pcm, piper.sample_rate_hz, CLIP_RATE_HZ).astype(np.float32)


def speech_edges(pcm: np.ndarray, rate: int = CLIP_RATE_HZ) -> tuple[float, float]:
    """(first, last) second where 10 ms frames are louder than -40 dBFS."""
    hop = rate // 100
    frames = pcm[: pcm.size - pcm.size % hop].reshape(-1, hop)
    db = 20 * np.log10(np.sqrt(np.mean(frames.astype(np.float64) ** 2, axis=1)) + 1e-9)
    loud = np.flatnonzero(db > EDGE_DBFS)
    return (loud[0] * hop / rate, (loud[-1] + 1) * hop / rate) if loud.size else (0.0, 0.0)


@dataclass(frozen=True)
class Spoken:
    text: str
    start_s: float  # speech onset in the clip
    end_s: float  # speech end in the clip


def caller_clip(parts: list[str | float]) -> tuple[np.ndarray, list[Spoken]]:
    pieces: list[np.ndarray] = []
    spoken: list[Spoken] = []
    at = 0
    for part in parts:
        if isinstance(part, str):
            pcm = say(part)
            first, last = speech_edges(pcm)
            spoken.append(Spoken(part, at / CLIP_RATE_HZ + first, at / CLIP_RATE_HZ + last))
        else:
            pcm = np.zeros(int(part * CLIP_RATE_HZ), np.float32)
        pieces.append(pcm)
        at += pcm.size
    return np.concatenate(pieces), spoken


def write_wav(path: Path, pcm: np.ndarray, rate: int = CLIP_RATE_HZ) -> Path:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes())
    return path


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate on lowercased words without punctuation."""
    import re

    ref = re.findall(r"[a-z0-9']+", reference.lower())
    hyp = re.findall(r"[a-z0-9']+", hypothesis.lower())
    d = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, d[0] = d[0], i
        for j, h in enumerate(hyp, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (r != h))
    return d[len(hyp)] / max(1, len(ref))


def clip_track(pcm_16k: np.ndarray, loop_clip: bool = False):
    """An aiortc microphone that plays a 16 kHz clip as paced 20 ms 48 kHz mono frames, then silence
    (or the clip again, `loop_clip`); its `pos` is the clip sample (at 48 kHz) it has reached."""
    import asyncio
    import fractions
    import time

    from aiortc.mediastreams import MediaStreamTrack
    from av import AudioFrame

    pcm_48k = soxr.resample(pcm_16k, CLIP_RATE_HZ, 48000).astype(np.float32)
    samples = (np.clip(pcm_48k, -1, 1) * 32767).astype(np.int16)

    class _Track(MediaStreamTrack):
        kind = "audio"

        def __init__(self) -> None:
            super().__init__()
            self.pos = 0
            self.started_s: float | None = None

        async def recv(self) -> AudioFrame:
            n = 960
            if self.started_s is None:
                self.started_s = time.monotonic()
            wait = self.started_s + self.pos / 48000 - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            start = self.pos % samples.size if loop_clip else self.pos
            chunk = samples[start : start + n]
            if chunk.size < n:
                chunk = np.concatenate((chunk, np.zeros(n - chunk.size, np.int16)))
            frame = AudioFrame.from_ndarray(chunk.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = 48000
            frame.pts = self.pos
            frame.time_base = fractions.Fraction(1, 48000)
            self.pos += n
            return frame

    return _Track()
