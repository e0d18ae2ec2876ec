"""CosyVoice3's prompt mel: CosyVoice2's Matcha `mel_spectrogram` with fmax = None (Nyquist, 12 kHz)."""

from __future__ import annotations

import numpy as np
from torch import Tensor

from voicertc.backends.cosyvoice.voice import features as v2_features

PROMPT_MEL_FMAX_HZ: float | None = None  # cosyvoice3.yaml feat_extractor.fmax (CosyVoice2: 8000)


def prompt_mel(wav_24k: Tensor | np.ndarray) -> Tensor:
    """The flow's prompt mel of 24 kHz audio: [1, N] -> [1, N // 480, 80] (50 Hz), fmax = None."""
    return v2_features.prompt_mel(wav_24k, PROMPT_MEL_FMAX_HZ)
