"""`CosyVoice2ForCausalLM`: transformers' Qwen2 causal LM whose output layer has a bias.

The exported CosyVoice2 LLM (`voicertc export vllm`) has the speech vocabulary on both ends: input
embeddings = `speech_embedding` [6564, H], `lm_head` = `llm_decoder` (weight and bias). Qwen2's own
`lm_head` has no bias, hence this subclass. The file is self-contained (torch + transformers only): the
export copies it next to the weights as `modeling_cosyvoice2.py` so that
`AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)` works without voicertc installed.
"""

from __future__ import annotations

from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

ARCHITECTURE = "CosyVoice2ForCausalLM"


class CosyVoice2ForCausalLM(Qwen2ForCausalLM):
    """Qwen2ForCausalLM with `lm_head` = Linear(hidden, vocab, bias=True) and untied embeddings."""

    config_class = Qwen2Config

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        self.post_init()
