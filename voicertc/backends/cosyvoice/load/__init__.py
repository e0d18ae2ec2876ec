"""One entry point for an official model directory: `load(model_dir, device, dtype)` picks CosyVoice2 or
CosyVoice3 from the yaml the directory holds, builds its networks (`v2.build` / `v3.build`) and, unless
told not to, smoke-runs every frontend file now (`voice.frontend_checks`), so a missing or broken one
stops the start naming the file. Imports torch only when called (light submodules stay light).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
    from voicertc.backends.cosyvoice.load.v3 import CosyVoice3Model


def load(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    check_frontend: bool = True,
) -> CosyVoice2Model:
    """The model of `model_dir`, v2 or v3 by its yaml (a `CosyVoice3Model` is a `CosyVoice2Model`)."""
    from voicertc.backends.cosyvoice.load.files import model_version

    if model_version(model_dir) == 3:
        return load_v3(model_dir, device, dtype, check_frontend=check_frontend)
    return load_v2(model_dir, device, dtype, check_frontend=check_frontend)


def load_v2(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    check_frontend: bool = True,
) -> CosyVoice2Model:
    """A CosyVoice2 directory (`voicertc.backends.cosyvoice2.load`); LLM and flow in `dtype`."""
    import torch

    from voicertc.backends.cosyvoice.load.v2 import build

    model = build(Path(model_dir), torch.device(device), dtype or torch.float32)
    if check_frontend:
        _check_frontend(model)
    return model


def load_v3(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    check_frontend: bool = False,
) -> CosyVoice3Model:
    """A CosyVoice3 directory (`voicertc.backends.cosyvoice3.load`); flow in `dtype`, the LLM float32."""
    import torch

    from voicertc.backends.cosyvoice.load.v3 import build

    model = build(Path(model_dir), torch.device(device), dtype or torch.float32)
    if check_frontend:
        _check_frontend(model)
    return model


def _check_frontend(model: CosyVoice2Model) -> None:
    from voicertc.backends.cosyvoice.voice.frontend_checks import check_frontend

    check_frontend(model)
