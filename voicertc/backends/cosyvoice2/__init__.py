"""CosyVoice2 public names (kept for compatibility): the code lives in `voicertc.backends.cosyvoice`.

The public names are re-exported lazily (PEP 562), so importing a light submodule such as
`yaml_config` does not pull in torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "load": "load:load_v2",
    "CosyVoice2Model": "load.v2",
    "Qwen2LM": "llm.qwen2lm",
    "LlmConfig": "llm.qwen2lm",
    "LlmSession": "llm.qwen2lm",
    "PrefixCache": "llm.qwen2lm",
    "build_llm": "llm.qwen2lm",
    "load_llm_state_dict": "llm.qwen2lm",
    "EOS_ID": "llm.qwen2lm",
    "FILL_ID": "llm.qwen2lm",
    "STOP_IDS": "llm.qwen2lm",
    "SPEECH_TOKEN_SIZE": "llm.qwen2lm",
    "SamplingParams": "llm.sampling",
    "BistreamSession": "llm.bistream",
    "TextFrontend": "voice.text",
    "TextTokenizer": "voice.text",
    "SentenceStream": "voice.text",
    "split_paragraph": "voice.text",
    "text_normalize": "voice.text",
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
    from voicertc.backends.cosyvoice.llm.bistream import BistreamSession
    from voicertc.backends.cosyvoice.llm.qwen2lm import (
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
    from voicertc.backends.cosyvoice.llm.sampling import SamplingParams
    from voicertc.backends.cosyvoice.load import load_v2 as load
    from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
    from voicertc.backends.cosyvoice.voice.text import (
        SentenceStream,
        TextFrontend,
        TextTokenizer,
        split_paragraph,
        text_normalize,
    )


def __getattr__(name: str) -> Any:
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attr = where.partition(":")  # "module" or "module:attribute" (a renamed export)
    return getattr(importlib.import_module(f"voicertc.backends.cosyvoice.{module}"), attr or name)
