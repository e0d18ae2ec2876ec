"""The streaming flow estimator as an exportable module: caches in, new caches out (see
`voicertc.backends.cosyvoice.flow.graph` for the tensor contract)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.flow.graph import INPUT_NAMES, OUTPUT_NAMES, GraphLayout, StreamingEstimator
from voicertc.backends.cosyvoice.flow.unet import CausalConditionalDecoder

logger = logging.getLogger(__name__)


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
