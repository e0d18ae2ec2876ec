"""The estimators' attention projections as one matmul (q, k and v of a block from one weight).

Engine thread. A captured Euler step of the full-size UNet launches ~460 separate matmuls, three of
every attention block's four being q, k and v of the same input (`bench.step_kernels`); stacked into
one weight they are one launch (the decode layer's `FusedLayer` does the same for the LLM). The stacked
weight is a non-persistent buffer made from the loaded projections (`fuse_qkv`, after loading: the
state dict and its keys are unchanged), so it follows `.to()`; the captured path turns it on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def project_qkv(attn: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v of `x` [B, T, C] ([B, T, inner] each): one matmul when `attn` is fused."""
    weight = attn._buffers.get("qkv_weight")
    if weight is None:
        return _linear(attn, "to_q")(x), _linear(attn, "to_k")(x), _linear(attn, "to_v")(x)
    q, k, v = F.linear(x, weight, attn._buffers.get("qkv_bias")).chunk(3, dim=-1)
    return q, k, v


def project_heads(
    attn: nn.Module, x: Tensor, heads: int, head_dim: int
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """q, k, v of `x` [B, T, C] as [B, H, T, Dh] views, and k, v as one [2, B, H, T, Dh] view of the same
    memory when `attn` is fused (None otherwise): the captured step writes both into its cache in one copy."""
    b, t = x.shape[0], x.shape[1]
    weight = attn._buffers.get("qkv_weight")
    if weight is None:
        q, k, v = (p.view(b, t, heads, head_dim).transpose(1, 2) for p in project_qkv(attn, x))
        return q, k, v, None
    stacked = F.linear(x, weight, attn._buffers.get("qkv_bias")).view(b, t, 3, heads, head_dim)
    qkv = stacked.permute(2, 0, 3, 1, 4)  # [3, B, H, T, Dh]
    return qkv[0], qkv[1], qkv[2], qkv[1:]


def _linear(module: nn.Module, name: str) -> nn.Linear:
    layer = getattr(module, name)
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"{type(module).__name__}.{name} is not a Linear")
    return layer


def init_qkv(attn: nn.Module) -> None:
    """Declare the (empty) stacked projection of an attention module (its __init__)."""
    attn.register_buffer("qkv_weight", None, persistent=False)
    attn.register_buffer("qkv_bias", None, persistent=False)


@torch.no_grad()
def fuse_qkv(estimator: nn.Module) -> int:
    """Stack every attention block's q/k/v of `estimator` (loaded weights); returns how many."""
    fused = 0
    for module in estimator.modules():
        if "qkv_weight" not in module._buffers:
            continue
        projections = [_linear(module, name) for name in ("to_q", "to_k", "to_v")]
        module._buffers["qkv_weight"] = torch.cat([p.weight for p in projections])
        biases: list[Tensor] = [p.bias for p in projections if p.bias is not None]
        module._buffers["qkv_bias"] = torch.cat(biases) if len(biases) == 3 else None
        fused += 1
    return fused
