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
from pathlib import Path

import torch
from torch import Tensor, nn

from voicertc.backends.cosyvoice.hift.conv_stft import ConvStft
from voicertc.backends.cosyvoice.hift.generator import HiFTGenerator
from voicertc.backends.cosyvoice.hift.source import SourceDraws

logger = logging.getLogger(__name__)


class HiftDecodeGraph(nn.Module):
    """mel [B, 80, T], source [B, 1, T * 480] -> wav [B, T * 480] (HiFT's decode, conv STFT)."""

    def __init__(self, hift: HiFTGenerator) -> None:
        super().__init__()
        c = hift.config
        self.hift = copy.deepcopy(hift)
        self.transform = ConvStft(c.istft_n_fft, c.istft_hop, hift.stft_window)

    def forward(self, mel: Tensor, source: Tensor) -> Tensor:
        return self.hift.decode_eager(mel, source, self.transform)


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
