"""vLLM general plugin: registers `CosyVoice2ForCausalLM` with vLLM's ModelRegistry.

Declared in pyproject.toml as `[project.entry-points."vllm.general_plugins"] cosyvoice2 = ...`, so every
vLLM process (also its worker processes) registers the architecture of `voicertc export vllm` before it
loads a model. vLLM is imported only here, lazily: it is never installed on CPU machines.
"""

from __future__ import annotations

import logging

from voicertc.backends.cosyvoice.llm.vllm.hf_model import ARCHITECTURE

logger = logging.getLogger(__name__)

MODEL_CLASS = "voicertc.backends.cosyvoice.llm.vllm.model:CosyVoice2ForCausalLM"


def register() -> None:
    """Entry point: idempotent registration (a string path, so vLLM imports the class lazily too)."""
    from vllm import ModelRegistry

    if ARCHITECTURE in ModelRegistry.get_supported_archs():
        return
    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    logger.info("registered %s with vLLM", ARCHITECTURE)
