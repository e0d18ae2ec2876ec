"""Prompt-audio features for CosyVoice2: the flow's prompt mel, Whisper log-mel, Kaldi fbank.

Each matches the library the reference calls (Matcha `mel_spectrogram`, `whisper.log_mel_spectrogram`,
`torchaudio.compliance.kaldi.fbank`) without depending on it: the mel filterbanks are computed here
(librosa's Slaney formulas, Kaldi's mel banks), the transforms with torch.stft / torch.fft.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import soxr
import torch
import torch.nn.functional as F
from torch import Tensor

from voicertc.errors import InputError

PROMPT_SAMPLE_RATE_HZ = 24000
TOKENIZER_SAMPLE_RATE_HZ = 16000

_SLANEY_HZ_PER_MEL = 200.0 / 3
_SLANEY_LOG_START_HZ = 1000.0
_SLANEY_LOG_START_MEL = _SLANEY_LOG_START_HZ / _SLANEY_HZ_PER_MEL
_SLANEY_LOG_STEP = math.log(6.4) / 27.0


def _hz_to_slaney_mel(hz: np.ndarray | float) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    log_part = _SLANEY_LOG_START_MEL + np.log(np.maximum(hz, 1e-10) / _SLANEY_LOG_START_HZ) / _SLANEY_LOG_STEP
    return np.where(hz >= _SLANEY_LOG_START_HZ, log_part, hz / _SLANEY_HZ_PER_MEL)


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    log_part = _SLANEY_LOG_START_HZ * np.exp(_SLANEY_LOG_STEP * (mel - _SLANEY_LOG_START_MEL))
    return np.where(mel >= _SLANEY_LOG_START_MEL, log_part, mel * _SLANEY_HZ_PER_MEL)


@functools.lru_cache(maxsize=8)
def slaney_mel_basis(
    sample_rate_hz: int, n_fft: int, n_mels: int, fmin_hz: float = 0.0, fmax_hz: float | None = None
) -> np.ndarray:
    """librosa.filters.mel(htk=False, norm='slaney') as float32 [n_mels, 1 + n_fft // 2].

    Triangles evenly spaced on the Slaney mel scale (linear below 1 kHz, log above), each scaled to unit
    area. Rounded to float32 before the area scaling, as librosa stores them.
    """
    fmax_hz = sample_rate_hz / 2 if fmax_hz is None else fmax_hz
    fft_hz = np.fft.rfftfreq(n_fft, d=1.0 / sample_rate_hz)
    mel_edges = np.linspace(_hz_to_slaney_mel(fmin_hz), _hz_to_slaney_mel(fmax_hz), n_mels + 2)
    edges_hz = _slaney_mel_to_hz(mel_edges)
    widths_hz = np.diff(edges_hz)
    ramps = edges_hz[:, None] - fft_hz[None, :]
    rising = -ramps[:-2] / widths_hz[:-1, None]
    falling = ramps[2:] / widths_hz[1:, None]
    triangles = np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)
    area_norm = 2.0 / (edges_hz[2:] - edges_hz[:-2])
    return (triangles * area_norm[:, None]).astype(np.float32)


def _as_batch(wav: Tensor | np.ndarray) -> Tensor:
    wav = torch.as_tensor(wav, dtype=torch.float32)
    if wav.dim() == 1:
        wav = wav[None]
    if wav.dim() != 2 or wav.shape[1] == 0:
        raise InputError(f"expected mono audio [1, N] with N > 0, got shape {list(wav.shape)}")
    return wav


def prompt_mel(wav_24k: Tensor | np.ndarray, fmax_hz: float | None = 8000.0) -> Tensor:
    """The flow's prompt mel (Matcha `mel_spectrogram`, cosyvoice2.yaml `feat_extractor`), 50 Hz.

    fmax 8000 is CosyVoice2's value; None means Nyquist (CosyVoice3).
    """
    # wav_24k: [1, N] -> mel: [1, N // 480, 80]
    wav = _as_batch(wav_24k)
    n_fft, hop = 1920, 480
    pad = (n_fft - hop) // 2
    if wav.shape[1] <= pad:
        raise InputError(f"prompt audio too short for a mel frame: {wav.shape[1]} samples")
    padded = F.pad(wav[:, None], (pad, pad), mode="reflect")[:, 0]
    window = torch.hann_window(n_fft, periodic=True)
    spec = torch.stft(padded, n_fft, hop, n_fft, window=window, center=False, return_complex=True)
    magnitude = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-9)
    basis = torch.from_numpy(slaney_mel_basis(PROMPT_SAMPLE_RATE_HZ, n_fft, 80, 0.0, fmax_hz))
    mel = torch.log(torch.clamp(basis @ magnitude, min=1e-5))
    return mel.transpose(1, 2)


def whisper_log_mel(wav_16k: Tensor | np.ndarray, n_mels: int = 128) -> Tensor:
    """openai-whisper's `log_mel_spectrogram`: the speech tokenizer's input, 100 Hz.

    Power spectrum of a centred 25 ms periodic-Hann STFT (last frame dropped), Slaney mel, log10 floored
    8 decades below the utterance maximum, then mapped by (x + 4) / 4.
    """
    # wav_16k: [1, N] -> log_mel: [1, n_mels, N // 160]
    wav = _as_batch(wav_16k)
    n_fft, hop = 400, 160
    if wav.shape[1] <= n_fft // 2:
        raise InputError(f"prompt audio too short for the speech tokenizer: {wav.shape[1]} samples")
    window = torch.hann_window(n_fft, periodic=True)
    spec = torch.stft(wav, n_fft, hop, window=window, center=True, pad_mode="reflect", return_complex=True)
    power = spec[..., :-1].abs().pow(2)
    basis = torch.from_numpy(slaney_mel_basis(TOKENIZER_SAMPLE_RATE_HZ, n_fft, n_mels))
    log_mel = torch.clamp(basis @ power, min=1e-10).log10()
    log_mel = torch.maximum(log_mel, log_mel.amax(dim=(1, 2), keepdim=True) - 8.0)
    return (log_mel + 4.0) / 4.0


def _kaldi_mel(hz: np.ndarray | float) -> np.ndarray:
    return 1127.0 * np.log(1.0 + np.asarray(hz, dtype=np.float64) / 700.0)


@functools.lru_cache(maxsize=4)
def kaldi_mel_banks(
    n_mels: int = 80, padded_window: int = 512, sample_rate_hz: int = 16000, low_hz: float = 20.0
) -> np.ndarray:
    """Kaldi's triangular mel banks (mel = 1127 ln(1 + f/700)), [n_mels, padded_window // 2 + 1].

    Triangles are linear on the mel axis between equally spaced mel edges from low_hz to Nyquist; the
    Nyquist bin always gets weight 0, as in Kaldi.
    """
    low_mel, high_mel = _kaldi_mel(low_hz), _kaldi_mel(sample_rate_hz / 2)
    step = (high_mel - low_mel) / (n_mels + 1)
    left = low_mel + step * np.arange(n_mels)[:, None]
    center, right = left + step, left + 2 * step
    bin_mel = _kaldi_mel(np.arange(padded_window // 2) * sample_rate_hz / padded_window)[None, :]
    rising = (bin_mel - left) / (center - left)
    falling = (right - bin_mel) / (right - center)
    banks = np.maximum(0.0, np.minimum(rising, falling))
    return np.pad(banks, ((0, 0), (0, 1))).astype(np.float32)


def kaldi_fbank(wav_16k: Tensor | np.ndarray, n_mels: int = 80, subtract_mean: bool = True) -> Tensor:
    """torchaudio.compliance.kaldi.fbank (dither 0, CosyVoice's settings) + per-utterance mean removal.

    25 ms / 10 ms frames without padding (snip_edges), DC removal, pre-emphasis 0.97, Povey window, 512-
    point power spectrum, natural log floored at float32 eps. This is CAM++'s input.
    """
    # wav_16k: [1, N] -> fbank: [1 + (N - 400) // 160, n_mels]
    wav = _as_batch(wav_16k)[0]
    frame, shift, padded = 400, 160, 512
    if wav.shape[0] < frame:
        raise InputError(f"prompt audio too short for a fbank frame: {wav.shape[0]} samples")
    frames = wav.unfold(0, frame, shift)
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = frames - 0.97 * previous
    frames = frames * torch.hann_window(frame, periodic=False).pow(0.85)
    power = torch.fft.rfft(frames, n=padded).abs().pow(2)
    banks = torch.from_numpy(kaldi_mel_banks(n_mels, padded, TOKENIZER_SAMPLE_RATE_HZ))
    eps = torch.tensor(torch.finfo(torch.float32).eps)
    fbank = torch.maximum(power @ banks.T, eps).log()
    if subtract_mean:
        fbank = fbank - fbank.mean(dim=0, keepdim=True)
    return fbank


def resample_wav(wav: np.ndarray, from_hz: int, to_hz: int) -> np.ndarray:
    """Mono float32 audio resampled with soxr (prompt audio to 16 kHz / 24 kHz).

    Like the reference loader, prompt audio below 16 kHz is refused: it cannot carry the bands the
    features expect.
    """
    wav = np.asarray(wav, dtype=np.float32)
    if wav.ndim != 1:
        raise InputError(f"expected mono audio [N], got shape {list(wav.shape)}")
    if from_hz < TOKENIZER_SAMPLE_RATE_HZ:
        raise InputError(f"prompt audio must be at least 16000 Hz, got {from_hz} Hz")
    if from_hz == to_hz:
        return wav
    return soxr.resample(wav, from_hz, to_hz).astype(np.float32)
