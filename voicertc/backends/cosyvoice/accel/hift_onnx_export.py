"""HiFT's decoder as an ONNX graph: `hift_decode.onnx` (mel + excitation -> waveform).

The excitation (f0 predictor + harmonic source) stays in torch: it is a few percent of HiFT's work, and
it integrates the phase over the chunk (hundreds of radians) before taking sines, so a different
kernel's float32 rounding of f0 (~5e-4 Hz) moves the samples by ~4e-4, beyond the 1e-4 parity bound.
The runner therefore draws and builds the excitation exactly as the eager module does, overwrites its
first samples with the previous chunk's tail, and runs the decoder graph; `hift_stream_step` runs
unchanged on it. ONNX has no inverse STFT, so both transforms are written as (transposed) convolutions
with the windowed DFT basis: the same centred, reflect-padded STFT and window-normalised overlap-add as
`torch.stft` / `torch.istft`.
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voicertc.backends.cosyvoice.hift.generator import HiFTGenerator
from voicertc.backends.cosyvoice.hift.source import SourceDraws

logger = logging.getLogger(__name__)


def _dft_kernels(n_fft: int, window: Tensor) -> tuple[Tensor, Tensor]:
    """Forward kernel [n_fft + 2, 1, n_fft] (real rows then imaginary rows) and the inverse one."""
    bins = n_fft // 2 + 1
    n = torch.arange(n_fft, dtype=torch.float64)
    k = torch.arange(bins, dtype=torch.float64)
    angle = 2 * math.pi * k[:, None] * n[None, :] / n_fft  # [bins, n_fft]
    w = window.to(torch.float64)[None, :]
    forward = torch.cat([torch.cos(angle) * w, -torch.sin(angle) * w])[:, None, :]
    weight = torch.full((bins, 1), 2.0, dtype=torch.float64)
    weight[0] = 1.0
    if n_fft % 2 == 0:
        weight[-1] = 1.0
    inverse = torch.cat([torch.cos(angle) * weight, -torch.sin(angle) * weight]) * w / n_fft
    return forward.float(), inverse[:, None, :].float()


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
        self.register_buffer("window_sq", (window.float() ** 2)[None, None, :], persistent=False)

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


class HiftDecodeGraph(nn.Module):
    """mel [B, 80, T], source [B, 1, T * 480] -> wav [B, T * 480] (HiFT's decode, conv STFT)."""

    def __init__(self, hift: HiFTGenerator) -> None:
        super().__init__()
        c = hift.config
        self.hift = copy.deepcopy(hift)
        self.transform = ConvStft(c.istft_n_fft, c.istft_hop, hift.stft_window)
        self.hift._stft = self.transform.stft  # type: ignore[method-assign]
        self.hift._istft = self.transform.istft  # type: ignore[method-assign]

    def forward(self, mel: Tensor, source: Tensor) -> Tensor:
        return self.hift.decode(mel, source)


def export_hift(hift: HiFTGenerator, out: Path, opset: int = 18) -> list[Path]:
    """Write `hift_decode.onnx` (float32) into `out`."""
    hift = hift.float().eval()
    c = hift.config
    frames = 20
    mel = torch.randn(1, c.in_channels, frames)
    draws = SourceDraws.draw(
        1, frames * c.samples_per_frame, c.nb_harmonics + 1, torch.Generator().manual_seed(0)
    )
    path = out / "hift_decode.onnx"
    with torch.no_grad():
        source = hift.source_from_f0(hift.f0(mel), draws)
        torch.onnx.export(
            HiftDecodeGraph(hift),
            (mel, source),
            str(path),
            input_names=["mel", "source"],
            output_names=["wav"],
            dynamic_axes={"mel": {0: "batch", 2: "frames"}, "source": {0: "batch", 2: "samples"},
                          "wav": {0: "batch", 1: "samples"}},
            opset_version=opset,
            dynamo=False,
        )  # fmt: skip
    logger.info("exported the HiFT decoder to %s", path)
    return [path]
