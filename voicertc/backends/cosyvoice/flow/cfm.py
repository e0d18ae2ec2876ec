"""Conditional flow matching sampler of the CosyVoice2 flow: 10 cosine-scheduled Euler steps with
classifier-free guidance, starting from a fixed noise tensor indexed by absolute frame.

The noise is what makes chunked synthesis deterministic: frame f always starts from noise[:, :, f],
whichever chunk it falls in. Each Euler step has its own estimator caches (the estimator sees a
different x at every step), one per utterance with the CFG pair as its two rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from voicertc.backends.cosyvoice.flow.config import NOISE_FRAMES, EstimatorConfig
from voicertc.backends.cosyvoice.flow.unet import CausalConditionalDecoder, EstimatorCache

_NOISE_SEED = 0
_noise_cpu: Tensor | None = None


def fixed_noise() -> Tensor:
    """The official `rand_noise`: randn(1, 80, 15000) from a CPU generator seeded 0 (made once)."""
    global _noise_cpu
    if _noise_cpu is None:
        generator = torch.Generator().manual_seed(_NOISE_SEED)
        _noise_cpu = torch.randn(1, 80, NOISE_FRAMES, generator=generator)
    return _noise_cpu


def cosine_t_span(n_timesteps: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """t_k = 1 - cos(k / n * pi / 2), k = 0..n, computed in the order the reference does."""
    t_span = torch.linspace(0, 1, n_timesteps + 1, dtype=dtype)
    return 1 - torch.cos(t_span * 0.5 * math.pi)


class CausalConditionalCFM(nn.Module):
    """Holds the estimator (checkpoint prefix `decoder.estimator`) and runs the Euler sampler."""

    def __init__(
        self,
        cfg: EstimatorConfig | None,
        n_timesteps: int,
        cfg_rate: float,
        estimator: nn.Module | None = None,
    ) -> None:
        """`estimator` replaces the UNet built from `cfg` (CosyVoice3 passes its DiT, same call signature)."""
        super().__init__()
        if estimator is None:
            if cfg is None:
                raise ValueError("CausalConditionalCFM needs an estimator config or an estimator")
            estimator = CausalConditionalDecoder(cfg)
        self.estimator = estimator
        self.n_timesteps = n_timesteps
        self.cfg_rate = cfg_rate
        # an exported graph runner with the estimator's call signature (`[engine] estimator`); None = eager
        self.estimator_runner: Callable[..., Tensor] | None = None

    def new_caches(self) -> list[EstimatorCache]:
        """One estimator cache per Euler step for one utterance."""
        return [EstimatorCache() for _ in range(self.n_timesteps)]

    def forward(
        self,
        noise: Tensor,
        mu: Tensor,
        spks: Tensor,
        cond: Tensor,
        step_caches: list[list[EstimatorCache]],
        chunk_masks: bool,
    ) -> Tensor:
        # noise, mu, cond: [N, 80, T] new frames of N utterances; spks: [N, 80];
        # step_caches[n][k]: utterance n, Euler step k -> mel [N, 80, T]
        n, bins, frames = mu.shape
        t_span = cosine_t_span(self.n_timesteps).to(mu.device, mu.dtype)
        # rows per utterance: [conditional, unconditional (mu, speaker, cond zeroed)]
        mu_in = torch.stack([mu, torch.zeros_like(mu)], dim=1).view(2 * n, bins, frames)
        spks_in = torch.stack([spks, torch.zeros_like(spks)], dim=1).view(2 * n, bins)
        cond_in = torch.stack([cond, torch.zeros_like(cond)], dim=1).view(2 * n, bins, frames)
        x = noise
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(self.n_timesteps):
            x_in = x.unsqueeze(1).expand(n, 2, bins, frames).reshape(2 * n, bins, frames)
            t_in = t.expand(2 * n)
            caches = [utterance[step] for utterance in step_caches]
            estimate = self.estimator_runner or self.estimator
            out = estimate(x_in, mu_in, t_in, spks_in, cond_in, caches, chunk_masks)
            out = out.view(n, 2, bins, frames)
            velocity = (1.0 + self.cfg_rate) * out[:, 0] - self.cfg_rate * out[:, 1]
            x = x + dt * velocity
            t = t + dt
            if step < self.n_timesteps - 1:
                dt = t_span[step + 2] - t
        return x.float()
