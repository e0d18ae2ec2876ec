"""Caller clips for the listening tests, synthesized at test time by the bundled Piper voice.

A clip is a list of parts: text (spoken) or a float (seconds of silence). `caller_clip` returns the
16 kHz float PCM and the speech edges of every spoken part (first/last sample above -40 dBFS in
10 ms frames), so tests can check events against the clip's own timeline. The clip machinery lives
in `bench/mic.py` (the benchmarks use it too).
"""

from __future__ import annotations

import re
import wave
from pathlib import Path

import numpy as np

from bench.mic import CLIP_RATE_HZ, ClipTrack, Spoken, caller_clip, say, speech_edges

__all__ = [
    "CLIP_RATE_HZ",
    "Spoken",
    "caller_clip",
    "clip_track",
    "g722_only",
    "say",
    "speech_edges",
    "wer",
    "write_wav",
]


def clip_track(pcm_16k: np.ndarray, loop_clip: bool = False) -> ClipTrack:
    """An aiortc microphone playing the clip (see `bench.mic.ClipTrack`)."""
    return ClipTrack(pcm_16k, loop_clip)


def write_wav(path: Path, pcm: np.ndarray, rate: int = CLIP_RATE_HZ) -> Path:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes())
    return path


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate on lowercased words without punctuation."""
    ref = re.findall(r"[a-z0-9']+", reference.lower())
    hyp = re.findall(r"[a-z0-9']+", hypothesis.lower())
    d = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, d[0] = d[0], i
        for j, h in enumerate(hyp, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (r != h))
    return d[len(hyp)] / max(1, len(ref))


def g722_only(sdp: str) -> str:
    """The offer with its audio m-line cut down to G722 (a codec aiortc does not take)."""
    out, in_audio = [], False
    for line in sdp.split("\r\n"):
        if line.startswith("m="):
            in_audio = line.startswith("m=audio")
            if in_audio:
                line = " ".join([*line.split(" ")[:3], "9"])
        elif in_audio and re.match(r"a=(rtpmap|fmtp|rtcp-fb):", line):
            if line.startswith("a=rtpmap:") and not re.match(r"a=rtpmap:9 ", line):
                continue
            if not line.startswith("a=rtpmap:"):
                continue
        out.append(line)
    text = "\r\n".join(out)
    return text
