"""Loads an official `hift.pt` into `HiFTGenerator`, folding weight norm once at load time.

The official checkpoint stores each weight-normed layer as a magnitude `g` and a direction `v`
(`*.parametrizations.weight.original0/1` with torch >= 2.1, `*.weight_g/weight_v` before). The folded
weight is w = g · v / ‖v‖ with the norm over every dimension but 0, so inference pays nothing for it.
Keys and shapes are checked strictly against the layout the official module would have, so a checkpoint
for another model size fails at load, naming the key and the file.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.hift.generator import HiFTGenerator
from voicertc.backends.cosyvoice.load.checkpoint import check_layout
from voicertc.errors import ModelDirError

logger = logging.getLogger(__name__)

_G = ".parametrizations.weight.original0"
_V = ".parametrizations.weight.original1"
_OLD = {".weight_g": _G, ".weight_v": _V}


def official_layout(module: HiFTGenerator) -> dict[str, tuple[int, ...]]:
    """The official state-dict keys and shapes this module corresponds to (weight norm unfolded)."""
    normed = set(module.weight_normed_layers())
    layout: dict[str, tuple[int, ...]] = {}
    for name, tensor in module.state_dict().items():
        layer, _, leaf = name.rpartition(".")
        if leaf == "weight" and layer in normed:
            layout[layer + _G] = (tensor.shape[0],) + (1,) * (tensor.dim() - 1)
            layout[layer + _V] = tuple(tensor.shape)
        else:
            layout[name] = tuple(tensor.shape)
    return layout


def _official_names(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Strip the `generator.` prefix and rename old-style weight_g/weight_v keys."""
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        name = key.removeprefix("generator.")
        for old, new in _OLD.items():
            if name.endswith(old):
                name = name[: -len(old)] + new
        out[name] = value
    return out


def fold_weight_norm(g: Tensor, v: Tensor) -> Tensor:
    """w = g · v / ‖v‖, the norm taken over all dimensions but 0 (torch's weight_norm with dim=0)."""
    norm = v.reshape(v.shape[0], -1).norm(dim=1).reshape(g.shape)
    return v * (g / norm)


def load_hift_state_dict(module: HiFTGenerator, state_dict: dict[str, Tensor], source_name: str) -> None:
    """Fold and load an official HiFT state dict into `module`; `source_name` names the file in errors."""
    found = _official_names(state_dict)
    check_layout(found, official_layout(module), source_name, "HiFT built from cosyvoice2.yaml")
    folded: dict[str, Tensor] = {}
    for key, value in found.items():
        if key.endswith(_G):
            layer = key[: -len(_G)]
            folded[layer + ".weight"] = fold_weight_norm(value.float(), found[layer + _V].float())
        elif not key.endswith(_V):
            folded[key] = value.float()
    module.load_state_dict(folded, strict=True)
    module.eval()


def load_hift_file(module: HiFTGenerator, path: str | Path) -> None:
    """Load `hift.pt` (official format) into `module`."""
    path = Path(path)
    if not path.is_file():
        raise ModelDirError(f"{path}: HiFT checkpoint not found")
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a corrupt archive
        raise ModelDirError(f"{path}: cannot read HiFT checkpoint ({exc})") from exc
    if not isinstance(state_dict, dict):
        raise ModelDirError(f"{path}: expected a state dict, got {type(state_dict).__name__}")
    load_hift_state_dict(module, state_dict, str(path))
    logger.info("loaded HiFT from %s (%d tensors)", path, len(state_dict))
