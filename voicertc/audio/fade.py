"""Gain ramps that keep cuts click-free: a fade-out of what is queued on barge-in, a fade-in at a start.

The ramps exclude their end points: a fade-out of n samples goes from just below 1 (the sample before
it had gain 1) to just above 0 (the sample after it is silence), so the largest gain step between any
two neighbouring samples is 1/(n+1) (linear) or about pi/(2(n+1)) (raised cosine).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

FadeShape = Literal["linear", "raised_cosine"]


def fade_out_gain(n_samples: int, shape: FadeShape = "raised_cosine") -> np.ndarray:
    """[n] float32 gains falling from ~1 to ~0 (both end points excluded)."""
    x = np.arange(1, n_samples + 1, dtype=np.float64) / (n_samples + 1)  # (0, 1)
    if shape == "linear":
        gain = 1.0 - x
    elif shape == "raised_cosine":
        gain = 0.5 * (1.0 + np.cos(np.pi * x))
    else:
        raise ValueError(f"unknown fade shape {shape!r} (linear | raised_cosine)")
    return gain.astype(np.float32)


def fade_in_gain(n_samples: int, shape: FadeShape = "raised_cosine") -> np.ndarray:
    """[n] float32 gains rising from ~0 to ~1 (both end points excluded)."""
    return fade_out_gain(n_samples, shape)[::-1].copy()


def fade_out(pcm: np.ndarray, shape: FadeShape = "raised_cosine") -> np.ndarray:
    """A copy of `pcm` (float or int16, 1-D) faded out over its whole length; same dtype."""
    return _apply(pcm, fade_out_gain(len(pcm), shape))


def fade_in(pcm: np.ndarray, shape: FadeShape = "raised_cosine") -> np.ndarray:
    """A copy of `pcm` (float or int16, 1-D) faded in over its whole length; same dtype."""
    return _apply(pcm, fade_in_gain(len(pcm), shape))


def _apply(pcm: np.ndarray, gain: np.ndarray) -> np.ndarray:
    pcm = np.asarray(pcm)
    if pcm.ndim != 1:
        raise ValueError(f"fades take 1-D mono PCM, got shape {pcm.shape}")
    faded = pcm.astype(np.float32) * gain
    if pcm.dtype == np.int16:
        return np.round(faded).astype(np.int16)
    return faded.astype(pcm.dtype)
