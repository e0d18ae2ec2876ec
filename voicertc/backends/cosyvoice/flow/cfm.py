"""Conditional flow matching sampler of the CosyVoice2 flow: 10 cosine-scheduled Euler steps with
classifier-free guidance, starting from a fixed noise tensor indexed by absolute frame.

The noise is what makes chunked synthesis deterministic: frame f always starts from noise[:, :, f],
whichever chunk it falls in. Each Euler step has its own estimator caches (the estimator sees a
different x at every step), one per utterance with the CFG pair as its two rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from voicertc.backends.cosyvoice.flow.config import NOISE_FRAMES, EstimatorConfig
from voicertc.backends.cosyvoice.flow.unet import CausalConditionalDecoder, EstimatorCache
from voicertc.engine.parts import run_to_end

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
        solve = self.start(noise, mu, spks, cond, step_caches, chunk_masks)
        self.advance(solve)
        return solve.x.float()

    def start(
        self,
        noise: Tensor,
        mu: Tensor,
        spks: Tensor,
        cond: Tensor,
        step_caches: list[list[EstimatorCache]],
        chunk_masks: bool,
    ) -> EulerSolve:
        """A solve before its first Euler step (`advance` runs them; `forward` is start + advance all)."""
        n, bins, frames = mu.shape
        # the solver's state and times stay float32 whatever the estimator runs in: in bfloat16 the times
        # (t_1 = 0.0123 -> 3 significant digits) and ten accumulated updates of x lose what the estimator
        # keeps; only the estimator's input is cast to its dtype
        t_span = cosine_t_span(self.n_timesteps).to(mu.device)
        # rows per utterance: [conditional, unconditional (mu, speaker, cond zeroed)]
        return EulerSolve(
            x=noise.float(),
            mu_in=torch.stack([mu, torch.zeros_like(mu)], dim=1).view(2 * n, bins, frames),
            spks_in=torch.stack([spks, torch.zeros_like(spks)], dim=1).view(2 * n, bins),
            cond_in=torch.stack([cond, torch.zeros_like(cond)], dim=1).view(2 * n, bins, frames),
            step_caches=step_caches,
            chunk_masks=chunk_masks,
            t_span=t_span,
            t=t_span[0],
            dt=t_span[1] - t_span[0],
        )

    def advance(self, solve: EulerSolve, steps: int | None = None) -> bool:
        """Run the next `steps` Euler steps of `solve` (None: all left; a step begun in parts is
        finished first and counts as one); whether it is done."""
        last = self.n_timesteps if steps is None else min(self.n_timesteps, solve.step + steps)
        while solve.step < last:
            if solve.parts is None:
                solve.parts = self._euler_step(solve, in_parts=False)
            run_to_end(solve.parts)
            solve.parts = None
        return solve.step >= self.n_timesteps

    def advance_part(self, solve: EulerSolve) -> bool:
        """Run the next part of `solve`: one stage of the estimator's forward when the eager estimator
        runs in parts (`forward_parts`), else one whole Euler step (an exported or captured runner is
        one call); whether the solve is done. Parts compute exactly what whole steps do."""
        if solve.step >= self.n_timesteps:
            return True
        if solve.parts is None:
            solve.parts = self._euler_step(solve, in_parts=True)
        try:
            next(solve.parts)
        except StopIteration:
            solve.parts = None
        return solve.step >= self.n_timesteps

    def _euler_step(self, solve: EulerSolve, in_parts: bool) -> Generator[None, None, None]:
        # Euler step `solve.step` (in parts: a yield after each estimator part); x, t, dt move on at its end
        n, bins, frames = solve.x.shape
        step = solve.step
        dtype = solve.mu_in.dtype  # the estimator's
        x_in = solve.x.to(dtype).unsqueeze(1).expand(n, 2, bins, frames).reshape(2 * n, bins, frames)
        t_in = solve.t.to(dtype).expand(2 * n)
        caches = [utterance[step] for utterance in solve.step_caches]
        inputs = (x_in, solve.mu_in, t_in, solve.spks_in, solve.cond_in, caches, solve.chunk_masks)
        parted = getattr(self.estimator, "forward_parts", None) if self.estimator_runner is None else None
        if in_parts and callable(parted):
            out = yield from parted(*inputs)
        else:
            out = (self.estimator_runner or self.estimator)(*inputs)
        out = out.float().view(n, 2, bins, frames)
        velocity = (1.0 + self.cfg_rate) * out[:, 0] - self.cfg_rate * out[:, 1]
        solve.x = solve.x + solve.dt * velocity
        solve.t = solve.t + solve.dt
        if step < self.n_timesteps - 1:
            solve.dt = solve.t_span[step + 2] - solve.t
        solve.step = step + 1


@dataclass
class EulerSolve:
    """One CFM solve between Euler steps (engine thread): `x` after `step` of the n steps, and what
    every step reads. A full-attention call is solved a few steps per engine step through it."""

    x: Tensor  # [N, 80, T] float32
    mu_in: Tensor  # [2N, 80, T] rows per utterance: conditional, unconditional
    spks_in: Tensor  # [2N, 80]
    cond_in: Tensor  # [2N, 80, T]
    step_caches: list[list[EstimatorCache]]
    chunk_masks: bool
    t_span: Tensor  # [n + 1] float32
    t: Tensor
    dt: Tensor
    step: int = 0
    parts: Generator[None, None, None] | None = None  # Euler step `step` begun in parts, not yet done
