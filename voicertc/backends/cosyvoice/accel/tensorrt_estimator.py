"""`[engine] estimator = "tensorrt"`: the streaming estimator graph as a TensorRT engine (CUDA only).

NEVER RUN ON A GPU YET (no GPU in the sessions that wrote it). What is CPU-proven is the graph it is
built from (`voicertc export onnx`, ONNX Runtime parity test) and the cache packing it shares with the
ONNX Runtime runner (`GraphEstimator`).

Build (once per GPU, cached as a plan next to the ONNX file):
- one optimisation profile over rows (2 .. 2N: the CFG pairs of up to N utterances), chunk frames and
  cached frames, instead of the reference's fixed batch-2 profile (cosyvoice.md §8, §6.4 item 7);
- fp16 without the reference's NaN pitfalls (§9 item 15): the attention mask is a finite -1e4 bias,
  never -inf; softmax, layer norms, reductions, exp/pow and the activation-by-activation matmuls (the
  attention scores and their weighted sum, which can exceed the fp16 range) are pinned to fp32 with
  OBEY_PRECISION_CONSTRAINTS, while the weight matmuls and convolutions run in fp16; inputs and outputs
  stay fp32.
Run: one execution context, inputs bound by address on the caller's current CUDA stream, no host syncs
(the caller's stream orders everything; the reference syncs twice per Euler step, §6.4 item 6).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.flow.graph import (
    INPUT_NAMES,
    OUTPUT_NAMES,
    GraphEstimator,
    GraphLayout,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Profile:
    """min / opt / max of the three dynamic sizes."""

    rows: tuple[int, int, int] = (2, 8, 64)
    frames: tuple[int, int, int] = (2, 100, 400)
    cached: tuple[int, int, int] = (1, 500, 3000)


def _shapes(layout: GraphLayout, rows: int, frames: int, cached: int) -> dict[str, tuple[int, ...]]:
    a, h, d = layout.attention_slots, layout.heads, layout.head_dim
    return {
        "x": (rows, 80, frames),
        "mu": (rows, 80, frames),
        "t": (rows,),
        "spks": (rows, 80),
        "cond": (rows, 80, frames),
        "conv_cache": (rows, layout.conv_channels, layout.conv_width),
        "kv_cache": (a, 2, rows, h, cached, d),
        "attn_bias": (rows, 1, frames, cached + frames),
    }


def _pin_fp32(network: Any, trt: Any) -> int:
    """Pin the fp16-fragile layers to fp32; returns how many were pinned."""
    fragile = {trt.LayerType.SOFTMAX, trt.LayerType.NORMALIZATION, trt.LayerType.REDUCE}
    producers = {}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        for j in range(layer.num_outputs):
            producers[layer.get_output(j).name] = layer
    pinned = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        pin = layer.type in fragile
        if layer.type == trt.LayerType.UNARY:
            pin = True  # exp, sqrt, sin, ...
        if layer.type == trt.LayerType.MATRIX_MULTIPLY:
            inputs = [producers.get(layer.get_input(k).name) for k in range(layer.num_inputs)]
            pin = all(p is not None and p.type != trt.LayerType.CONSTANT for p in inputs)
        if pin:
            layer.precision = trt.float32
            for j in range(layer.num_outputs):
                layer.set_output_type(j, trt.float32)
            pinned += 1
    return pinned


def build_engine(
    onnx_path: Path, plan_path: Path, layout: GraphLayout, profile: Profile, fp16: bool
) -> bytes:
    """Parse the ONNX graph and build a serialized engine (written to `plan_path`)."""
    import tensorrt as trt

    trt_logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(trt_logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, trt_logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"{onnx_path}: TensorRT cannot parse the graph ({errors})")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 1 << 32)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        logger.info("TensorRT fp16: %d fragile layers pinned to fp32", _pin_fp32(network, trt))
    opt = builder.create_optimization_profile()
    lo, mid, hi = (
        _shapes(layout, *[p[k] for p in (profile.rows, profile.frames, profile.cached)]) for k in range(3)
    )
    for name in INPUT_NAMES:
        opt.set_shape(name, lo[name], mid[name], hi[name])
    config.add_optimization_profile(opt)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"{onnx_path}: TensorRT engine build failed")
    plan_path.write_bytes(bytes(plan))
    logger.info("built TensorRT engine %s", plan_path)
    return bytes(plan)


class TensorRTEstimator(GraphEstimator):
    """The estimator graph on TensorRT; inputs/outputs are CUDA float32 tensors."""

    def __init__(
        self, onnx_path: str | Path, layout: GraphLayout, fp16: bool = True, profile: Profile | None = None
    ) -> None:
        super().__init__(layout)
        import tensorrt as trt

        onnx_path = Path(onnx_path)
        gpu = torch.cuda.get_device_name().replace(" ", "_")
        plan_path = onnx_path.with_suffix(f".{'fp16' if fp16 else 'fp32'}.{gpu}.plan")
        if plan_path.is_file():
            plan = plan_path.read_bytes()
        else:
            plan = build_engine(onnx_path, plan_path, layout, profile or Profile(), fp16)
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        self.context = self.engine.create_execution_context()

    def run(self, inputs: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        bound = {k: v.detach().float().contiguous() for k, v in inputs.items()}
        for name, tensor in bound.items():
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        outputs = []
        for name in OUTPUT_NAMES:
            shape = tuple(self.context.get_tensor_shape(name))
            out = torch.empty(shape, dtype=torch.float32, device=bound["x"].device)
            self.context.set_tensor_address(name, out.data_ptr())
            outputs.append(out)
        if not self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise RuntimeError("TensorRT estimator execution failed")
        return outputs[0], outputs[1], outputs[2]
