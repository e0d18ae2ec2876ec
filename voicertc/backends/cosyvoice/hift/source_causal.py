"""CosyVoice3's causal neural-source-filter excitation (`SourceModuleHnNSF(causal=True)` / `SineGen2`).

Differences from CosyVoice2 (`cosyvoice2.hift_source`): no per-call randomness. The official module
draws fixed buffers once at construction — an initial phase `rand_ini` [1, 9] (fundamental zeroed) and
uniform [0, 1) noise `sine_waves` [1, 7200000, 9] — and every call slices them by absolute sample
position; the integrated phase is upsampled with *nearest* (not linear) interpolation.

Everything is frame-causal, so a stream computes the excitation chunk by chunk: the running phase sum
is carried (appended in the order `cumsum` adds, so the values are the whole-call ones bit for bit)
and the noise is read at the chunk's absolute positions. Several streams (rows) run as one batch, each
with its own `SourceState` (phase sum, position in the noise).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voicertc.backends.cosyvoice.accel.staging import to_device
from voicertc.backends.cosyvoice.hift.source import SineParams

DEFAULT_NOISE_SEED = 1986  # our own buffers (the official values depend on the RNG state at construction)
NOISE_BLOCK_SAMPLES = 24000
CACHED_BLOCKS = 64  # one-second blocks kept per device (~0.9 MB each): every stream reads the same ones


class NoiseBuffers:
    """`rand_ini` [1, H] and the uniform noise [1, L, H] by absolute sample position.

    Injected buffers (`set`) are used as given; otherwise (and beyond an injected prefix) seeded uniform
    blocks of one second are drawn on demand and the last `CACHED_BLOCKS` kept per device, so memory
    stays bounded. Every stream reads the buffer at its own sample position, so streams at once read the
    same first blocks: each is drawn (on the host, the same values for every device) and copied to a
    device once, not per call and row."""

    def __init__(self, harmonics: int, seed: int = DEFAULT_NOISE_SEED) -> None:
        self.harmonics = harmonics
        self.seed = seed
        generator = torch.Generator().manual_seed(seed)
        self.rand_ini = torch.rand(1, harmonics, generator=generator)
        self.rand_ini[:, 0] = 0
        self.sine_waves: Tensor | None = None
        self._blocks: OrderedDict[tuple[int, torch.device], Tensor] = OrderedDict()
        self.drawn_blocks = 0  # blocks drawn on the host (a counter for tests and diagnostics)

    def set(self, rand_ini: Tensor, sine_waves: Tensor) -> None:
        if rand_ini.shape != (1, self.harmonics):
            raise ValueError(f"rand_ini must have shape [1, {self.harmonics}], got {list(rand_ini.shape)}")
        if sine_waves.dim() != 3 or sine_waves.shape[0] != 1 or sine_waves.shape[2] != self.harmonics:
            raise ValueError(
                f"sine_waves must have shape [1, L, {self.harmonics}], got {list(sine_waves.shape)}"
            )
        self.rand_ini = rand_ini.detach().float().cpu().clone()
        self.sine_waves = sine_waves.detach().float().cpu().contiguous()

    def noise(self, start: int, end: int, device: torch.device | None = None) -> Tensor:
        """Noise samples [start, end) as [1, end - start, H] float32 on `device` (the host by default)."""
        device = torch.device("cpu") if device is None else device
        if self.sine_waves is not None:
            injected = self.sine_waves.shape[1]
            if end <= injected:
                return self.sine_waves[:, start:end].to(device)
            if start < injected:  # an injected prefix (the reference's is 300 s) continues with our own
                head = self.sine_waves[:, start:].to(device)
                return torch.cat([head, self._generated(injected, end, device)], dim=1)
        return self._generated(start, end, device)

    def _generated(self, start: int, end: int, device: torch.device) -> Tensor:
        first, stop = start // NOISE_BLOCK_SAMPLES, -(-end // NOISE_BLOCK_SAMPLES)
        parts = [self._block_at(b, device) for b in range(first, stop)]
        joined = torch.cat(parts, dim=1) if parts else torch.zeros(1, 0, self.harmonics, device=device)
        offset = start - first * NOISE_BLOCK_SAMPLES
        return joined[:, offset : offset + end - start]

    def _block_at(self, index: int, device: torch.device) -> Tensor:
        key = (index, device)
        block = self._blocks.get(key)
        if block is None:
            host = self._blocks.get((index, torch.device("cpu")))
            if host is None:
                generator = torch.Generator().manual_seed(self.seed + 1 + index)
                host = torch.rand(1, NOISE_BLOCK_SAMPLES, self.harmonics, generator=generator)
                self.drawn_blocks += 1
            block = to_device(host, device)  # pinned: no wait for the work queued before
            self._blocks[key] = block
            while len(self._blocks) > CACHED_BLOCKS:
                self._blocks.popitem(last=False)
        self._blocks.move_to_end(key)
        return block


@dataclass
class SourceState:
    """Per-stream excitation state: frames done and the running (not yet 2π-scaled) phase sums."""

    frames: int = 0
    phase_sum: Tensor | None = None  # [1, 1, H] float64 running sum

    def copy(self) -> SourceState:
        return SourceState(self.frames, self.phase_sum)  # the sum is replaced, never written in place


class CausalSourceModule(nn.Module):
    """Merges the harmonic sines into one excitation channel (`m_source` in the checkpoint)."""

    def __init__(self, params: SineParams) -> None:
        super().__init__()
        self.params = params
        self.l_linear = nn.Linear(params.harmonics, 1)
        self.buffers_ = NoiseBuffers(params.harmonics)

    def forward(self, f0: Tensor, states: list[SourceState]) -> Tensor:
        # f0: [B, n] Hz (float32), row b for frames states[b].frames.. -> source [B, 1, n * 480]
        p = self.params
        scale = p.upsample_scale
        rows = f0.shape[0]
        if len(states) != rows:
            raise ValueError(f"{rows} f0 rows but {len(states)} source states")
        if f0.shape[1] == 0:
            return f0.new_zeros(rows, 1, 0)
        f0_up = f0.repeat_interleave(scale, dim=1).unsqueeze(-1)  # [B, L, 1]
        orders = torch.arange(1, p.harmonics + 1, dtype=torch.float32, device=f0.device)
        rad = (f0_up * orders[None, None, :] / p.sample_rate_hz) % 1
        for row, state in enumerate(states):
            if state.frames == 0:  # the initial phase enters each stream's first sample only
                rad[row, 0, :] = rad[row, 0, :] + self.buffers_.rand_ini[0].to(rad)
        rad_frames = F.interpolate(rad.transpose(1, 2), scale_factor=1 / scale, mode="linear").transpose(1, 2)
        # torch's CPU cumsum accumulates float32 in float64: carry that accumulator, prepended so the
        # additions happen in the whole-call order
        wide = rad_frames.to(torch.float64)
        zero = wide.new_zeros(1, 1, p.harmonics)
        carry = torch.cat([s.phase_sum if s.phase_sum is not None else zero for s in states], dim=0)
        sums = torch.cumsum(torch.cat([carry, wide], dim=1), dim=1)[:, 1:]
        for row, state in enumerate(states):
            state.phase_sum = sums[row : row + 1, -1:]
        phase = sums.to(rad_frames.dtype) * 2 * np.pi
        phase = F.interpolate(phase.transpose(1, 2) * scale, scale_factor=scale, mode="nearest").transpose(
            1, 2
        )
        sines = torch.sin(phase) * p.sine_amp
        uv = (f0_up > p.voiced_threshold_hz).to(torch.float32)
        noise_amp = uv * p.noise_std + (1 - uv) * p.sine_amp / 3
        length = f0_up.shape[1]
        device = f0_up.device
        buffers = [self.buffers_.noise(s.frames * scale, s.frames * scale + length, device) for s in states]
        noise = noise_amp * torch.cat(buffers, dim=0)
        for state in states:
            state.frames += f0.shape[1]
        return torch.tanh(self.l_linear(sines * uv + noise)).transpose(1, 2)
