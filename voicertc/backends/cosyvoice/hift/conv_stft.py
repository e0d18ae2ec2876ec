"""`torch.stft(center=True, reflect)` and `torch.istft(center=True)` as (transposed) convolutions with the
windowed DFT basis: the same centred, reflect-padded STFT and window-normalised overlap-add.

Used where torch's own transforms cannot go: an ONNX graph (ONNX has no inverse STFT) and a captured
CUDA graph (`torch.istft` checks its window envelope on the host, a device sync that capture forbids).
HiFT's n_fft is 16, so a convolution is as cheap as an FFT here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _dft_kernels(n_fft: int, window: Tensor) -> tuple[Tensor, Tensor]:
    """Forward kernel [n_fft + 2, 1, n_fft] (real rows then imaginary rows) and the inverse one, made in
    float64 and kept in the window's dtype."""
    bins = n_fft // 2 + 1
    n = torch.arange(n_fft, dtype=torch.float64)
    k = torch.arange(bins, dtype=torch.float64)
    angle = 2 * math.pi * k[:, None] * n[None, :] / n_fft  # [bins, n_fft]
    w = window.detach().to("cpu", torch.float64)[None, :]
    forward = torch.cat([torch.cos(angle) * w, -torch.sin(angle) * w])[:, None, :]
    weight = torch.full((bins, 1), 2.0, dtype=torch.float64)
    weight[0] = 1.0
    if n_fft % 2 == 0:
        weight[-1] = 1.0
    inverse = torch.cat([torch.cos(angle) * weight, -torch.sin(angle) * weight]) * w / n_fft
    return forward.to(window.device, window.dtype), inverse[:, None, :].to(window.device, window.dtype)


class ConvStft(nn.Module):
    """`torch.stft(center=True, reflect)` and `torch.istft(center=True)` as convolutions."""

    forward_kernel: Tensor
    inverse_kernel: Tensor
    window_sq: Tensor

    def __init__(self, n_fft: int, hop: int, window: Tensor) -> None:
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        forward, inverse = _dft_kernels(n_fft, window)
        self.register_buffer("forward_kernel", forward, persistent=False)
        self.register_buffer("inverse_kernel", inverse, persistent=False)
        self.register_buffer(
            "window_sq", (window.to(torch.float64) ** 2).to(window.dtype)[None, None, :], persistent=False
        )

    def stft(self, wav: Tensor) -> Tensor:
        # wav: [B, L] -> real ‖ imag: [B, n_fft + 2, L / hop + 1]
        half = self.n_fft // 2
        padded = F.pad(wav[:, None, :], (half, half), mode="reflect")
        return F.conv1d(padded, self.forward_kernel, stride=self.hop)

    def istft(self, magnitude: Tensor, phase: Tensor) -> Tensor:
        # magnitude, phase: [B, n_fft / 2 + 1, F] -> wav: [B, (F - 1) * hop]
        spec = torch.cat([magnitude * torch.cos(phase), magnitude * torch.sin(phase)], dim=1)
        frames = spec.shape[2]
        signal = F.conv_transpose1d(spec, self.inverse_kernel, stride=self.hop)[:, 0]
        ones = torch.ones_like(spec[:1, :1, :])
        envelope = F.conv_transpose1d(ones, self.window_sq, stride=self.hop)[:, 0]
        half = self.n_fft // 2
        length = (frames - 1) * self.hop
        return signal[:, half : half + length] / envelope[:, half : half + length]
