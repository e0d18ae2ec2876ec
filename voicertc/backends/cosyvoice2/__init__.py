"""CosyVoice2-compatible backend: loader, LLM, flow, HiFT and frontends for the official model directory.

The public names are re-exported lazily (PEP 562), so importing a light submodule such as
`yaml_config` does not pull in torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "load": "loader",
    "CosyVoice2Model": "loader",
    "Qwen2LM": "llm",
    "LlmConfig": "llm",
    "LlmSession": "llm",
    "PrefixCache": "llm",
    "build_llm": "llm",
    "load_llm_state_dict": "llm",
    "EOS_ID": "llm",
    "FILL_ID": "llm",
    "STOP_IDS": "llm",
    "SPEECH_TOKEN_SIZE": "llm",
    "SamplingParams": "sampling",
    "BistreamSession": "bistream",
    "TextFrontend": "text",
    "TextTokenizer": "text",
    "SentenceStream": "text",
    "split_paragraph": "text",
    "text_normalize": "text",
}

__all__ = [
    "BistreamSession",
    "CosyVoice2Model",
    "EOS_ID",
    "FILL_ID",
    "LlmConfig",
    "LlmSession",
    "PrefixCache",
    "Qwen2LM",
    "SPEECH_TOKEN_SIZE",
    "STOP_IDS",
    "SamplingParams",
    "SentenceStream",
    "TextFrontend",
    "TextTokenizer",
    "build_llm",
    "load",
    "load_llm_state_dict",
    "split_paragraph",
    "text_normalize",
]

if TYPE_CHECKING:
    from voicertc.backends.cosyvoice2.bistream import BistreamSession
    from voicertc.backends.cosyvoice2.llm import (
        EOS_ID,
        FILL_ID,
        SPEECH_TOKEN_SIZE,
        STOP_IDS,
        LlmConfig,
        LlmSession,
        PrefixCache,
        Qwen2LM,
        build_llm,
        load_llm_state_dict,
    )
    from voicertc.backends.cosyvoice2.loader import CosyVoice2Model, load
    from voicertc.backends.cosyvoice2.sampling import SamplingParams
    from voicertc.backends.cosyvoice2.text import (
        SentenceStream,
        TextFrontend,
        TextTokenizer,
        split_paragraph,
        text_normalize,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
