"""`voicertc export onnx MODEL_DIR OUT`: the streaming flow estimator and HiFT as ONNX graphs.

OUT gets `flow_estimator_stream.onnx` (chunk + caches in, velocity + new caches out; dynamic rows, chunk
frames and cached frames; see `voicertc.backends.cosyvoice.flow.graph`), `hift_source.onnx` and
`hift_decode.onnx` (see `accel.hift_onnx_export`). All float32; TensorRT builds its fp16 engine from the
estimator graph (`voicertc.backends.cosyvoice.accel.tensorrt_estimator`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from voicertc.backends.cosyvoice.accel.flow_onnx_export import export_estimator
from voicertc.backends.cosyvoice.accel.hift_onnx_export import export_hift
from voicertc.backends.cosyvoice.flow.flow import CausalFlow
from voicertc.backends.cosyvoice.flow.unet import CausalConditionalDecoder
from voicertc.backends.cosyvoice.hift.generator import HiftConfig, HiFTGenerator
from voicertc.backends.cosyvoice.hift.weights import load_hift_state_dict
from voicertc.backends.cosyvoice.load.v2 import YAML_NAME
from voicertc.backends.cosyvoice.load.yaml_config import load_yaml
from voicertc.errors import ModelDirError

logger = logging.getLogger(__name__)

ESTIMATOR_FILE = "flow_estimator_stream.onnx"


def load_hift(model_dir: Path) -> HiFTGenerator:
    config = load_yaml(model_dir / YAML_NAME)
    hift = HiFTGenerator(HiftConfig.from_yaml(config["hift"]))
    path = model_dir / "hift.pt"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise ModelDirError(f"{path}: cannot load ({exc})") from exc
    load_hift_state_dict(hift, state, str(path))
    return hift.eval()


def export_onnx(model_dir: str | Path, out: str | Path, opset: int = 18) -> list[Path]:
    """Write the three graphs of `model_dir` into `out` (created); returns their paths."""
    model_dir, out = Path(model_dir), Path(out)
    if not model_dir.is_dir():
        raise ModelDirError(f"{model_dir}: not a directory")
    flow = CausalFlow.from_model_dir(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    estimator = flow.decoder.estimator
    if not isinstance(estimator, CausalConditionalDecoder):
        raise ModelDirError(
            f"{model_dir}: the ONNX export covers CosyVoice2's estimator, not a {type(estimator).__name__}"
        )
    paths = [export_estimator(estimator, out / ESTIMATOR_FILE, opset)]
    paths += export_hift(load_hift(model_dir), out, opset)
    return paths
