"""CosyVoice3 (Fun-CosyVoice3-0.5B) backend: loader, DiT flow, causal HiFT, CosyVoice3LM, frontends.

What CosyVoice3 shares with CosyVoice2 (CFM solver, chunk masks, K/V caches, schedule, sampling, voices,
token2wav scheduling) is imported from `voicertc.backends.cosyvoice2`; what differs lives here. The
public names are re-exported lazily (PEP 562), so importing a light submodule does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "load": "loader",
    "CosyVoice3Model": "loader",
    "CosyVoice3LM": "llm",
    "CausalFlowV3": "flow",
    "CausalHiFTGenerator": "hift",
    "Token2WavStreamV3": "token2wav",
}

__all__ = [
    "CausalFlowV3",
    "CausalHiFTGenerator",
    "CosyVoice3LM",
    "CosyVoice3Model",
    "Token2WavStreamV3",
    "load",
]

if TYPE_CHECKING:
    from voicertc.backends.cosyvoice3.flow import CausalFlowV3
    from voicertc.backends.cosyvoice3.hift import CausalHiFTGenerator
    from voicertc.backends.cosyvoice3.llm import CosyVoice3LM
    from voicertc.backends.cosyvoice3.loader import CosyVoice3Model, load
    from voicertc.backends.cosyvoice3.token2wav import Token2WavStreamV3


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
