"""RAS as a vLLM V1 logits processor: `RasRows` on vLLM's `LogitsProcessor` base class.

Imported only inside vLLM's processes (vLLM checks that the class subclasses its base and loads it by its
qualified name, `LOGITS_PROCESSOR`), so CPU machines never import vllm.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.sample.logits_processor import LogitsProcessor

from voicertc.backends.cosyvoice.llm.vllm.ras import RasRows

LOGITS_PROCESSOR = "voicertc.backends.cosyvoice.llm.vllm.logits:RasLogitsProcessor"


class RasLogitsProcessor(RasRows, LogitsProcessor):
    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        RasRows.__init__(self)
