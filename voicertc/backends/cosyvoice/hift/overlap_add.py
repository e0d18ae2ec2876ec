"""The Hamming overlap-add CosyVoice2 uses to join vocoder chunks (`fade_in_out` semantics)."""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor


@functools.lru_cache(maxsize=4)
def hamming_window(samples: int) -> Tensor:
    """`np.hamming(samples)` as a float64 tensor (the reference multiplies by the float64 window)."""
    return torch.from_numpy(np.hamming(samples))


def fade_in_out(fade_in: Tensor, fade_out: Tensor, window: Tensor) -> Tensor:
    """Blend the head of `fade_in` with the tail of `fade_out` over len(window) // 2 samples.

    The rising half of the window weights the new audio, the falling half the old tail. The blend is
    computed in the window's precision (float64 for the reference's numpy window) and stored back in
    `fade_in`'s dtype, which is what the reference does. Hamming halves sum to ~1.08, not 1; kept for
    compatibility.
    """
    # fade_in: [..., N >= ov], fade_out: [..., M >= ov], window: [2 * ov] -> [..., N]
    overlap = window.shape[0] // 2
    if fade_in.shape[-1] < overlap or fade_out.shape[-1] < overlap:
        sizes = f"{fade_in.shape[-1]} and {fade_out.shape[-1]}"
        raise ValueError(f"fade_in_out needs {overlap} samples on both sides, got {sizes}")
    window = window.to(fade_in.device)
    out = fade_in.clone()
    head = fade_in[..., :overlap] * window[:overlap] + fade_out[..., -overlap:] * window[overlap:]
    out[..., :overlap] = head.to(out.dtype)
    return out
