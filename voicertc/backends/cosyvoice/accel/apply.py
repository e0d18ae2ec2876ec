"""Accelerated paths of a loaded CosyVoice2 model: `[engine] estimator`, `compile`, `llm`, `accel_dir`.

fp32 eager is the exact default and nothing here runs for it. Each option swaps one piece in place:
- estimator "onnx": the streaming estimator graph on ONNX Runtime (CPU), exported into `accel_dir` on
  first use; "tensorrt": the same graph as a TensorRT engine (CUDA only, never run yet);
- compile: `torch.compile` of the compute leaves of the LLM layers and the flow estimator
  (module.compile(): state-dict keys unchanged; dynamic shapes; see `compile_hot_modules`); with
  `cuda_graphs` instead the captured decode step is compiled whole (`llm.graphs.DecodeGraphs`);
- llm "vllm" / "thread": not here: `engine_backend.llm_streamer` builds the token streamer
  (`llm_stream`); vLLM's model is exported into `accel_dir/vllm` on first use (`vllm_export_dir`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from voicertc.errors import ConfigError

if TYPE_CHECKING:
    from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
    from voicertc.config import EngineConfig

logger = logging.getLogger(__name__)

ESTIMATORS = ("torch", "onnx", "tensorrt")
LLMS = ("torch", "thread", "vllm")


def accel_dir(engine: EngineConfig) -> Path:
    """Where exported artefacts live: `[engine] accel_dir`, or `<model_dir>/accel`."""
    return Path(engine.accel_dir) if engine.accel_dir else Path(engine.model_dir) / "accel"


def vllm_export_dir(engine: EngineConfig) -> Path:
    """The vLLM-format LLM (`voicertc export vllm`), exported now if it is not there yet."""
    from voicertc.backends.cosyvoice.accel.vllm_export import export_vllm

    out = accel_dir(engine) / "vllm"
    if not (out / "config.json").is_file():
        logger.info("exporting the LLM for vLLM to %s (first use)", out)
        export_vllm(engine.model_dir, out, dtype=engine.dtype)
    return out


def estimator_onnx(engine: EngineConfig) -> Path:
    """The streaming estimator graph, exported now if it is not there yet."""
    from voicertc.backends.cosyvoice.accel.onnx_export import ESTIMATOR_FILE, export_onnx

    path = accel_dir(engine) / ESTIMATOR_FILE
    if not path.is_file():
        logger.info("exporting the flow estimator to %s (first use)", path)
        export_onnx(engine.model_dir, path.parent)
    return path


def compile_hot_modules(model: CosyVoice2Model, estimator: bool = True) -> int:
    """`torch.compile` the shape-stable compute leaves (each LLM layer's MLP, each estimator feed-forward);
    the cache bookkeeping around them stays eager, so nothing recompiles per chunk. Returns how many."""
    from voicertc.backends.cosyvoice.flow.unet import FeedForward

    leaves = [layer.mlp for layer in model.llm.llm.model.model.layers]
    if estimator:
        leaves += [m for m in model.flow.decoder.estimator.modules() if isinstance(m, FeedForward)]
    for module in leaves:
        module.compile(dynamic=True)
    return len(leaves)


def apply_accel(model: CosyVoice2Model, engine: EngineConfig) -> None:
    """Swap in the configured accelerated pieces (on the loading thread, before the engine starts)."""
    from voicertc.backends.cosyvoice.flow.graph import GraphLayout

    estimator = model.flow.decoder.estimator
    if engine.estimator == "onnx":
        from voicertc.backends.cosyvoice.flow.graph import OnnxRuntimeEstimator

        model.flow.decoder.estimator_runner = OnnxRuntimeEstimator(
            estimator_onnx(engine), GraphLayout.of(estimator)
        )
    elif engine.estimator == "tensorrt":
        if model.device.type != "cuda":
            raise ConfigError("engine.estimator: tensorrt needs a CUDA device")
        from voicertc.backends.cosyvoice.accel.tensorrt_estimator import TensorRTEstimator

        fp16 = engine.dtype != "float32"
        runner = TensorRTEstimator(estimator_onnx(engine), GraphLayout.of(estimator), fp16=fp16)
        model.flow.decoder.estimator_runner = runner
    if engine.compile and not engine.cuda_graphs:  # with graphs: the captured decode step is compiled whole
        compile_hot_modules(model, estimator=engine.estimator == "torch")
    logger.info(
        "engine paths: dtype %s, estimator %s, compile %s, llm %s",
        engine.dtype,
        engine.estimator,
        engine.compile,
        engine.llm,
    )
