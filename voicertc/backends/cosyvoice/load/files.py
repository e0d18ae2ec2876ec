"""What both model versions read the same way: the yaml (once, tags checked), checkpoints, spk2info.

Nothing here builds a network; `load.v2` / `load.v3` do, each with its own expected tags.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.load.yaml_config import load_yaml, tag_of
from voicertc.errors import ModelDirError

logger = logging.getLogger(__name__)

BLANKEN_DIR = "CosyVoice-BlankEN"
YAML_NAMES = {"cosyvoice2.yaml": 2, "cosyvoice3.yaml": 3}
OTHER_YAML_NAMES = {"cosyvoice.yaml": "CosyVoice (v1)"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str, device: torch.device, *, half_on_cpu: bool = True) -> torch.dtype:
    """The one dtype rule: `[engine] dtype` on CUDA as written; on CPU float32, or bfloat16 when asked
    and the model allows it (`half_on_cpu`; float16 is never used on CPU)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    if device.type == "cuda":
        return DTYPES[name]
    return torch.bfloat16 if half_on_cpu and name == "bfloat16" else torch.float32


def cuda_settings(dtype: torch.dtype) -> None:
    """Process-wide CUDA switches (torch has no per-module ones), set when a model loads on CUDA.

    - float32 means float32: cuDNN's convolutions (and matmuls) default to TF32 on Ampere and later,
      which moved the flow's mel by 1.7e-3 on an H200;
    - no cuDNN attention: on Hopper it is the preferred SDPA backend for half precision, and it builds a
      new cuDNN graph whenever the key length changes, i.e. at every eager decode step (54 ms per bf16
      step at batch 1 on the H200, against 14 ms in fp32). The flash / memory-efficient kernels serve
      the same calls; the captured decode graphs never re-plan anyway.
    """
    if dtype == torch.float32:
        if torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32:
            logger.info("float32 on CUDA: TF32 convolutions and matmuls turned off (exact float32)")
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    if torch.backends.cuda.cudnn_sdp_enabled():
        logger.info("CUDA: cuDNN attention off (it re-plans for every new key length)")
        torch.backends.cuda.enable_cudnn_sdp(False)


def model_version(model_dir: str | Path) -> int:
    """2 or 3, from the yaml file the directory holds (a ModelDirError naming what is there otherwise)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelDirError(f"{model_dir}: not a directory")
    for name, version in YAML_NAMES.items():
        if (model_dir / name).is_file():
            return version
    for name, what in OTHER_YAML_NAMES.items():
        if (model_dir / name).is_file():
            raise ModelDirError(f"{model_dir / name}: this is a {what} model directory; not supported")
    raise ModelDirError(f"{model_dir}: no cosyvoice2.yaml or cosyvoice3.yaml; not a CosyVoice model dir")


def read_config(model_dir: Path, yaml_path: Path) -> dict[str, Any]:
    """The yaml as plain data, its Qwen2 path pointing into the directory."""
    return load_yaml(yaml_path, overrides={"qwen_pretrain_path": str(model_dir / BLANKEN_DIR)})


def check_tags(
    config: Mapping[str, Any], yaml_path: Path, expected: Mapping[str, str], known_other: Mapping[str, str]
) -> None:
    """Each network's `!new:` tag is the one this loader builds (else: which model it belongs to)."""
    for key, tag in expected.items():
        found = tag_of(config.get(key))
        if found == tag:
            continue
        version = known_other.get(found)
        what = f"a {version} class" if version else "something else"
        raise ModelDirError(f"{yaml_path}: `{key}` is !{found or 'missing'} ({what}); expected !{tag}")


def load_weights(path: Path) -> dict[str, Tensor]:
    """A state dict of tensors from `path` (a ModelDirError naming the file otherwise)."""
    if not path.is_file():
        raise ModelDirError(f"{path}: not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, pickle errors, ...: torch raises several types
        raise ModelDirError(f"{path}: cannot read the checkpoint ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ModelDirError(f"{path}: expected a state dict of tensors")
    return state


def load_spk2info(path: Path) -> dict[str, Any]:
    """Optional spk2info.pt: {speaker: {name: tensor}}; missing file = no voices. The entries are not
    validated here (VoiceBook does it per entry); an unreadable file only costs its voices."""
    if not path.is_file():
        return {}
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, pickle errors, ...: torch raises several types
        logger.error("%s: cannot read (%s: %s); its voices are disabled", path, type(exc).__name__, exc)
        return {}
    if not isinstance(raw, dict):
        logger.error("%s: expected {speaker id: {name: tensor}}, got %s; ignored", path, type(raw).__name__)
        return {}
    return {str(k): v for k, v in raw.items()}


def required(path: Path, who: str) -> Path:
    """`path` if it is a file, else a ModelDirError naming it and what needs it."""
    if not path.is_file():
        raise ModelDirError(f"{path}: not found (needed by the {who} frontend)")
    return path
