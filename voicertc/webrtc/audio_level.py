"""The RTP audio-level value (RFC 6465) of each outgoing frame, computed with numpy. Event loop.

aiortc's sender computes the level of every audio frame it sends on the event loop, in a Python loop
over the frame's samples (`aiortc.rtp.compute_audio_level_dbov`: 1,920 `struct` unpacks per 20 ms
stereo frame, 96,000 a second per call, silence included). A py-spy profile of four silent two-way
calls (2026-11-26) put it at about a third of the sending side's own work. `install()` swaps it, once
per process, for `audio_level_dbov`: the same formula over a numpy view of the same bytes, so the same
value for every frame (aiortc's sum of squares over all of plane 0, divided by `frame.samples`, then
its float arithmetic and rounding; `tests/test_audio_level.py` checks equality against aiortc's own).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from aiortc import rtp

MAX_SAMPLE_VALUE = 32767
MIN_AUDIO_LEVEL = -127
MAX_AUDIO_LEVEL = 0

AIORTC_AUDIO_LEVEL = rtp.compute_audio_level_dbov  # kept for the equality test


def audio_level_dbov(frame: Any) -> int:
    """-dBov of an s16 `av.AudioFrame`, as aiortc computes it (0 loudest, -127 silence)."""
    samples = np.frombuffer(frame.planes[0], dtype=np.int16).astype(np.int64)
    energy = int(np.dot(samples, samples))  # exact, as aiortc's integer sum
    rms = math.sqrt(energy / (frame.samples * MAX_SAMPLE_VALUE * MAX_SAMPLE_VALUE))
    if rms <= 0:
        return MIN_AUDIO_LEVEL
    db = min(max(20 * math.log10(rms), MIN_AUDIO_LEVEL), MAX_AUDIO_LEVEL)
    return round(db)


def install() -> None:
    """Make aiortc's senders use `audio_level_dbov` (idempotent; the sender reads `rtp.<name>` per frame)."""
    rtp.compute_audio_level_dbov = audio_level_dbov
