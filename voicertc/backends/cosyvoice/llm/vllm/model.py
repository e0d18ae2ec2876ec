"""`CosyVoice2ForCausalLM` for vLLM: vLLM's Qwen2 causal LM with a biased, untied `lm_head`.

Imported by vLLM only (through `llm.vllm.plugin`); it imports vllm at module level and never
runs on CPU machines. NEVER RUN ON A GPU YET: written against vLLM >= 0.11 (V1 engine), see README.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.utils import maybe_prefix


class CosyVoice2ForCausalLM(Qwen2ForCausalLM):
    """Qwen2 body, input embeddings = speech embedding, `lm_head` = `llm_decoder` (weight + bias)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_config
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            bias=True,
            quant_config=vllm_config.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )

    def compute_logits(self, hidden_states: torch.Tensor, *args: Any) -> torch.Tensor | None:
        # vLLM < 0.10.2 passes sampling_metadata as a second argument; newer versions do not
        return self.logits_processor(self.lm_head, hidden_states, *args, embedding_bias=self.lm_head.bias)
