"""HiFT's generator network as captured static-shape steps: one replay per (rows, mel frames) bucket.

Runs on the engine thread. `HiFTGenerator.decode(mel, source)` (mel + excitation -> waveform) is the
launch-bound part of a vocoder chunk; its rows are independent (per-row convolutions, STFT and ISTFT),
so rows are padded with zeros up to a power-of-two bucket exactly, and the frames (cache + new, equal in
a batch already) are a bucket's own. The STFT pair is `hift.conv_stft.ConvStft` (torch.istft checks its
window envelope on the host, which a capture forbids), also for the eager fallback, so every call of the
stage computes the same transform. The excitation (f0 -> phase -> sine/noise) stays eager: each
utterance draws it from its own generator, so it stays reproducible per utterance. A call past
`max_rows` or the memory budget runs eagerly, counted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.accel.captured import (
    Capture,
    GraphBudget,
    StageStats,
    StaticSteps,
    row_bucket,
    run_eagerly,
)
from voicertc.backends.cosyvoice.hift.conv_stft import ConvStft
from voicertc.backends.cosyvoice.hift.generator import HiFTGenerator


class CapturedHiftDecode:
    """`HiFTGenerator.decode_runner`: the generator network replayed per (rows, frames) bucket."""

    def __init__(
        self,
        hift: HiFTGenerator,
        *,
        max_rows: int = 32,
        capture: Capture = run_eagerly,
        budget: GraphBudget | None = None,
    ) -> None:
        self.hift = hift
        self.max_rows = max_rows
        c = hift.config
        self.transform = ConvStft(c.istft_n_fft, c.istft_hop, hift.stft_window)  # the window's device, dtype
        self.steps = StaticSteps(
            "hift decode", self._decode, (0, 0), (0,), capture=capture, budget=budget
        )  # fmt: skip

    def _decode(self, mel: Tensor, source: Tensor) -> tuple[Tensor]:
        return (self.hift.decode_eager(mel, source, self.transform),)

    @property
    def stats(self) -> StageStats:
        return self.steps.stats

    @torch.inference_mode()
    def warm(self, rows: list[int], frames: list[int], like: Tensor) -> int:
        """Capture the (rows, mel frames) buckets given now (start-up); how many were captured."""
        before = self.steps.stats.captures
        samples = self.hift.config.samples_per_frame
        for r in sorted(rows, reverse=True):  # the largest first: the smaller buckets' inputs are views
            for f in sorted(frames, reverse=True):
                padded = row_bucket(r, self.max_rows)
                if padded != r:
                    continue
                self.steps.run(r, [like.new_zeros(r, 80, f), like.new_zeros(r, 1, f * samples)])
                if self.steps.stats.failed is not None:
                    break
        return self.steps.stats.captures - before

    @torch.inference_mode()
    def __call__(self, mel: Tensor, source: Tensor) -> Tensor:
        # mel: [B, 80, T], source: [B, 1, T * 480] -> wav: [B, T * 480]
        padded = row_bucket(mel.shape[0], self.max_rows)
        if padded is not None:
            outputs = self.steps.run(padded, [mel, source])
            if outputs is not None:
                return outputs[0]
        else:
            self.steps.stats.eager += 1
        return self.hift.decode_eager(mel, source, self.transform)
