"""CosyVoice3 public names (kept for compatibility): the code lives in `voicertc.backends.cosyvoice`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "load": "load.v3",
    "CosyVoice3Model": "load.v3",
    "CosyVoice3LM": "llm.v3",
    "CausalFlowV3": "flow.flow_v3",
    "CausalHiFTGenerator": "hift.causal",
    "Token2WavStreamV3": "serve.token2wav_v3",
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
    from voicertc.backends.cosyvoice.flow.flow_v3 import CausalFlowV3
    from voicertc.backends.cosyvoice.hift.causal import CausalHiFTGenerator
    from voicertc.backends.cosyvoice.llm.v3 import CosyVoice3LM
    from voicertc.backends.cosyvoice.load.v3 import CosyVoice3Model, load
    from voicertc.backends.cosyvoice.serve.token2wav_v3 import Token2WavStreamV3


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"voicertc.backends.cosyvoice.{module}"), name)
