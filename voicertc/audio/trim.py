"""Leading-silence trim: where an utterance's audible speech starts, so playback can start there.

TTS voices open with tens of milliseconds of near-silence (Piper: 35-55 ms below -50 dBFS). Sending it
only delays what the listener hears, so the sink cuts it from an utterance's first piece, keeping a
short lead-in before the onset and never cutting more than a cap (a deliberate pause stays a pause).
"""

from __future__ import annotations

import numpy as np

ONSET_LEVEL = 0.003  # |sample| above this (about -50 dBFS) is audible speech
LEAD_IN_MS = 10.0  # near-silence kept before the onset, so the first phoneme's attack is intact


def leading_trim_samples(pcm: np.ndarray, sample_rate_hz: int, max_trim_ms: float) -> int:
    """How many leading samples of `pcm` (float, 1-D, in [-1, 1]) to drop: those before the first
    audible sample minus a `LEAD_IN_MS` lead-in, at most `max_trim_ms` worth."""
    cap = int(sample_rate_hz * max_trim_ms / 1000)
    if cap <= 0 or pcm.size == 0:
        return 0
    lead_in = int(sample_rate_hz * LEAD_IN_MS / 1000)
    window = pcm[: cap + lead_in]
    audible = np.flatnonzero(np.abs(window) > ONSET_LEVEL)
    onset = int(audible[0]) if audible.size else window.size
    return max(0, min(cap, onset - lead_in))
