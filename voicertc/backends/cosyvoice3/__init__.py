"""CosyVoice3 public names (kept for compatibility): the code lives in `voicertc.backends.cosyvoice`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "load": "load:load_v3",
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
    from voicertc.backends.cosyvoice.load import load_v3 as load
    from voicertc.backends.cosyvoice.load.v3 import CosyVoice3Model
    from voicertc.backends.cosyvoice.serve.token2wav_v3 import Token2WavStreamV3


def __getattr__(name: str) -> Any:
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attr = where.partition(":")  # "module" or "module:attribute" (a renamed export)
    return getattr(importlib.import_module(f"voicertc.backends.cosyvoice.{module}"), attr or name)
