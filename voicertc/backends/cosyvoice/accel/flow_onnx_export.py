"""The streaming flow estimator as an exportable module: caches in, new caches out (see
`voicertc.backends.cosyvoice.flow.graph` for the tensor contract)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from torch import Tensor, nn

from voicertc.backends.cosyvoice.flow.graph import INPUT_NAMES, OUTPUT_NAMES, GraphLayout
from voicertc.backends.cosyvoice.flow.unet import CausalConditionalDecoder

logger = logging.getLogger(__name__)


class _GraphBatch:
    """What the estimator's convs and attentions ask of a batch, answered from graph inputs."""

    def __init__(self, layout: GraphLayout, conv_cache: Tensor, kv_cache: Tensor, attn_bias: Tensor) -> None:
        self.layout = layout
        self.conv_cache, self.kv_cache, self.attn_bias = conv_cache, kv_cache, attn_bias
        self.new_tails: dict[int, Tensor] = {}
        self.new_kv: dict[int, tuple[Tensor, Tensor]] = {}

    def conv_context(self, slot: int, x: Tensor, width: int) -> Tensor:
        offset, channels = self.layout.conv_slots[slot]
        padded = torch.cat([self.conv_cache[:, offset : offset + channels, -width:], x], dim=2)
        self.new_tails[slot] = padded[:, :, -width:]
        return padded

    def attend(self, slot: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q, k, v: [B, H, T, Dh] -> [B, H, T, Dh] over [cached ++ new] keys; plain softmax attention
        self.new_kv[slot] = (k, v)
        keys = torch.cat([self.kv_cache[slot, 0], k], dim=2)
        values = torch.cat([self.kv_cache[slot, 1], v], dim=2)
        scores = (q @ keys.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])) + self.attn_bias
        return scores.softmax(dim=-1) @ values


class StreamingEstimator(nn.Module):
    """`CausalConditionalDecoder` with its caches as tensors (the graph of `voicertc export onnx`)."""

    def __init__(self, estimator: CausalConditionalDecoder) -> None:
        super().__init__()
        self.estimator = estimator
        self.layout = GraphLayout.of(estimator)

    def forward(
        self,
        x: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        conv_cache: Tensor,
        kv_cache: Tensor,
        attn_bias: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        batch = _GraphBatch(self.layout, conv_cache, kv_cache, attn_bias)
        velocity = self.estimator.forward_batch(x, mu, t, spks, cond, batch)
        conv_out = torch.cat([batch.new_tails[s] for s in range(len(self.layout.conv_slots))], dim=1)
        kv_new = torch.stack(
            [torch.stack(batch.new_kv[s]) for s in range(self.layout.attention_slots)]
        )  # [A, 2, B, H, T, Dh]
        return velocity, conv_out, kv_new


def example_inputs(
    layout: GraphLayout, rows: int = 4, frames: int = 20, cached: int = 30
) -> tuple[Tensor, ...]:
    """Random inputs of the graph's shapes (for tracing and smoke checks)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator)

    bias = torch.zeros(rows, 1, frames, cached + frames)
    return (
        randn(rows, 80, frames),
        randn(rows, 80, frames),
        torch.rand(rows, generator=generator),
        randn(rows, 80),
        randn(rows, 80, frames),
        randn(rows, layout.conv_channels, layout.conv_width),
        randn(layout.attention_slots, 2, rows, layout.heads, cached, layout.head_dim),
        bias,
    )


DYNAMIC_AXES = {
    "x": {0: "rows", 2: "frames"},
    "mu": {0: "rows", 2: "frames"},
    "t": {0: "rows"},
    "spks": {0: "rows"},
    "cond": {0: "rows", 2: "frames"},
    "conv_cache": {0: "rows"},
    "kv_cache": {2: "rows", 4: "cached"},
    "attn_bias": {0: "rows", 2: "frames", 3: "keys"},
    "velocity": {0: "rows", 2: "frames"},
    "conv_cache_out": {0: "rows"},
    "kv_new": {2: "rows", 4: "frames"},
}


def export_estimator(estimator: CausalConditionalDecoder, path: str | Path, opset: int = 18) -> Path:
    """Write the streaming estimator graph (float32) to `path`."""
    module = StreamingEstimator(estimator).eval().float()
    args = example_inputs(module.layout)
    with torch.no_grad():
        torch.onnx.export(
            module,
            args,
            str(path),
            input_names=list(INPUT_NAMES),
            output_names=list(OUTPUT_NAMES),
            dynamic_axes=DYNAMIC_AXES,
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )
    logger.info("exported the streaming flow estimator to %s", path)
    return Path(path)
