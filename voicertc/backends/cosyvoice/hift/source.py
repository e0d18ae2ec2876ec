"""HiFT's neural-source-filter excitation (CosyVoice2 `SourceModuleHnNSF` + `SineGen2` semantics).

The excitation is random on every call. To make it reproducible and testable, the random numbers are
drawn up front into `SourceDraws` (from a `torch.Generator`, or recorded ones injected by a test), and the
rest of the computation is a pure function of f0 and those draws. Drawing `rand(B, H)` first and then
`randn(B, L, H)` from one generator reproduces the reference's draw order after `torch.manual_seed`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class SourceDraws:
    """The random numbers one excitation uses.

    `initial_phase` is uniform [0, 1) per harmonic (the module zeroes the fundamental's entry);
    `noise` is standard normal, one value per sample and harmonic.
    """

    initial_phase: Tensor  # [B, H] uniform
    noise: Tensor  # [B, L, H] standard normal

    @staticmethod
    def draw(
        batch: int, samples: int, harmonics: int, generator: torch.Generator | None = None
    ) -> SourceDraws:
        """Fresh draws that consume `generator` exactly as one reference call consumes torch's RNG.

        The reference draws its noise with `randn_like` on a transposed (non-contiguous) tensor, which
        takes torch's scalar sampling path, and then a third, discarded `[B, L, 1]` draw; both are
        mirrored so a seeded generator gives the reference's excitation bit for bit. The draws are made
        on the generator's device: a CUDA generator (`[engine] cuda_graphs`) spares the host the ~1e6
        normal draws of a long chunk; the bit-for-bit parity is the CPU generator's.
        """
        device = generator.device if generator is not None else torch.device("cpu")  # a GPU's own draws
        initial_phase = torch.rand(batch, harmonics, generator=generator, device=device)
        noise = (
            torch.empty(batch, harmonics, samples, device=device).transpose(1, 2).normal_(generator=generator)
        )
        torch.empty(batch, samples, 1, device=device).normal_(generator=generator)
        return SourceDraws(initial_phase=initial_phase, noise=noise)


@dataclass(frozen=True)
class SineParams:
    """The NSF constants (yaml `nsf_*`, `sampling_rate`; `upsample_scale` = samples per mel frame)."""

    sample_rate_hz: int
    upsample_scale: int
    harmonics: int  # fundamental + nb_harmonics overtones
    sine_amp: float
    noise_std: float
    voiced_threshold_hz: float


def harmonic_excitation(f0_up: Tensor, draws: SourceDraws, params: SineParams) -> tuple[Tensor, Tensor]:
    """Noisy harmonic sines for an f0 track already repeated to the sample rate.

    The phase is integrated at the frame rate and linearly interpolated back up, as SineGen2 does, so the
    phase stays smooth across the 480-sample frame steps.
    """
    # f0_up: [B, L, 1] Hz -> sine_waves: [B, L, H], uv: [B, L, 1]
    orders = torch.arange(1, params.harmonics + 1, dtype=f0_up.dtype, device=f0_up.device)
    rad_per_sample = (f0_up * orders / params.sample_rate_hz) % 1
    initial_phase = draws.initial_phase.to(rad_per_sample).clone()
    initial_phase[:, 0] = 0
    rad_per_sample[:, 0, :] = rad_per_sample[:, 0, :] + initial_phase
    rad_per_frame = F.interpolate(
        rad_per_sample.transpose(1, 2), scale_factor=1 / params.upsample_scale, mode="linear"
    )
    phase = torch.cumsum(rad_per_frame, dim=2) * 2 * math.pi
    phase = F.interpolate(
        phase * params.upsample_scale, scale_factor=params.upsample_scale, mode="linear"
    ).transpose(1, 2)
    sines = torch.sin(phase) * params.sine_amp
    uv = (f0_up > params.voiced_threshold_hz).to(sines.dtype)
    noise_amp = uv * params.noise_std + (1 - uv) * params.sine_amp / 3
    sine_waves = sines * uv + noise_amp * draws.noise.to(sines)
    return sine_waves, uv


class SourceModule(nn.Module):
    """Merges the harmonic sines into one excitation channel (`m_source` in the checkpoint)."""

    def __init__(self, params: SineParams) -> None:
        super().__init__()
        self.params = params
        self.l_linear = nn.Linear(params.harmonics, 1)

    def forward(self, f0_up: Tensor, draws: SourceDraws) -> Tensor:
        # f0_up: [B, L, 1] Hz -> source: [B, L, 1] in (-1, 1)
        sine_waves, _ = harmonic_excitation(f0_up, draws, self.params)
        return torch.tanh(self.l_linear(sine_waves))
