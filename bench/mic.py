"""A caller's microphone for the listening benchmarks and tests: Piper-synthesized clips, paced as an
aiortc audio track that remembers when it sent each clip sample."""

from __future__ import annotations

import asyncio
import fractions
import functools
import time
from dataclasses import dataclass

import numpy as np
import soxr
from aiortc.mediastreams import MediaStreamTrack
from av import AudioFrame

CLIP_RATE_HZ = 16000
TRACK_RATE_HZ = 48000
FRAME_SAMPLES = 960  # 20 ms at 48 kHz
EDGE_DBFS = -40.0


@functools.cache
def _piper():  # type: ignore[no-untyped-def]
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
    """Parts are text (spoken by Piper) or seconds of silence: (16 kHz PCM, the spoken parts' edges)."""
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


class ClipTrack(MediaStreamTrack):
    """Plays a 16 kHz clip as paced 20 ms 48 kHz mono frames, then silence (or the clip again).

    `started_s` is the `time.monotonic()` of its first frame, so clip second `t` left at about
    `started_s + t` (`sent_at(t)`).
    """

    kind = "audio"

    def __init__(self, pcm_16k: np.ndarray, loop_clip: bool = False) -> None:
        super().__init__()
        pcm_48k = soxr.resample(pcm_16k, CLIP_RATE_HZ, TRACK_RATE_HZ).astype(np.float32)
        self.samples = (np.clip(pcm_48k, -1, 1) * 32767).astype(np.int16)
        self.loop_clip = loop_clip
        self.pos = 0
        self.started_s: float | None = None

    def sent_at(self, clip_s: float) -> float:
        assert self.started_s is not None
        return self.started_s + clip_s

    async def recv(self) -> AudioFrame:
        if self.started_s is None:
            self.started_s = time.monotonic()
        wait = self.started_s + self.pos / TRACK_RATE_HZ - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        start = self.pos % self.samples.size if self.loop_clip else self.pos
        chunk = self.samples[start : start + FRAME_SAMPLES]
        if chunk.size < FRAME_SAMPLES:
            chunk = np.concatenate((chunk, np.zeros(FRAME_SAMPLES - chunk.size, np.int16)))
        frame = AudioFrame.from_ndarray(chunk.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = TRACK_RATE_HZ
        frame.pts = self.pos
        frame.time_base = fractions.Fraction(1, TRACK_RATE_HZ)
        self.pos += FRAME_SAMPLES
        return frame
