"""The CosyVoice3 speech-token LLM (`CosyVoice3LM`): CosyVoice2's `Qwen2LM` with v3's special ids.

What differs from CosyVoice2 (everything else — Qwen2 backbone, input layout, KV-cached step-able
decoding, RAS / greedy sampling — is inherited):
* sos (6561) and task_id (6563) are rows of `speech_embedding` (no `llm_embedding` table);
* `speech_embedding` and `llm_decoder` have 6561 + 200 rows, `llm_decoder` has no bias;
* any id >= 6561 (200 stop ids) ends generation; below min_len the mask hits id 6561 (sos), not eos;
* the text (prompt text ++ text) must contain `<|endofprompt|>` (151646), as the reference asserts;
* text-in streaming (`llm.bistream`) reads fill 6564 / eos 6562 and feeds the prompt text up to
  `<|endofprompt|>` whole after sos (`bistream.V3_IDS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from voicertc.backends.cosyvoice.llm.qwen2lm import (
    SOS_ROW,
    TASK_ID_ROW,
    LlmConfig,
    LlmSession,
    PrefixCache,
    Qwen2Encoder,
    Qwen2LM,
    qwen2_config,
)
from voicertc.backends.cosyvoice.llm.sampling import SamplingMode

if TYPE_CHECKING:
    from voicertc.backends.cosyvoice.llm.kv import KVSlot

SPEECH_TOKEN_SIZE = 6561
SOS_ID = SPEECH_TOKEN_SIZE  # 6561
EOS_ID = SPEECH_TOKEN_SIZE + 1  # 6562
TASK_ID = SPEECH_TOKEN_SIZE + 2  # 6563
FILL_ID = SPEECH_TOKEN_SIZE + 3  # 6564
EXTRA_ROWS = 200
STOP_IDS = frozenset(range(SPEECH_TOKEN_SIZE, SPEECH_TOKEN_SIZE + EXTRA_ROWS))
ENDOFPROMPT_ID = 151646
COSYVOICE3LM_TAG = "new:cosyvoice.llm.llm.CosyVoice3LM"


class CosyVoice3LM(Qwen2LM):
    """The official `CosyVoice3LM` state-dict layout with CosyVoice2's step-able inference."""

    stop_ids = STOP_IDS
    min_len_ban_ids = (SOS_ID,)

    def __init__(self, config: LlmConfig) -> None:  # noqa: D107 - the parent's tables differ
        nn.Module.__init__(self)
        self.config = config
        self.sampling_params = config.sampling
        rows = config.speech_token_size + EXTRA_ROWS
        self.llm = Qwen2Encoder(qwen2_config(config.qwen2))
        self.llm_decoder = nn.Linear(config.output_size, rows, bias=False)
        self.speech_embedding = nn.Embedding(rows, config.input_size)

    def special_embedding(self, row: int) -> Tensor:
        index = {SOS_ROW: SOS_ID, TASK_ID_ROW: TASK_ID}[row]
        return self.speech_embedding.weight[index].reshape(1, 1, -1)

    # deliberately the signature of Qwen2LM.prefill (an override that checks the v3 prompt first)
    def prefill(
        self,
        text_tokens: Sequence[int] | Tensor,
        prompt_text_tokens: Sequence[int] | Tensor = (),
        prompt_speech_tokens: Sequence[int] | Tensor = (),
        *,
        sampling: SamplingMode = "ras",
        generator: torch.Generator | None = None,
        prefix: PrefixCache | None = None,
        kv: KVSlot | None = None,
    ) -> LlmSession:
        """As CosyVoice2's, after checking that `<|endofprompt|>` is in prompt text ++ text."""
        ids = [*self.check_text_ids(prompt_text_tokens), *self.check_text_ids(text_tokens)]
        if ENDOFPROMPT_ID not in ids:
            raise ValueError(
                f"CosyVoice3 needs <|endofprompt|> (id {ENDOFPROMPT_ID}) in the prompt text or the text "
                "(e.g. 'You are a helpful assistant.<|endofprompt|>' before the transcript)"
            )
        return super().prefill(
            text_tokens,
            prompt_text_tokens,
            prompt_speech_tokens,
            sampling=sampling,
            generator=generator,
            prefix=prefix,
            kv=kv,
        )
