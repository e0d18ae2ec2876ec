"""Which prompt the CosyVoice2 LLM gets, per inference mode (cosyvoice.md §2.5, §3.2).

The LLM input is always `[sos, embed(prompt_text ⧺ tts_text), task_id, speech_embedding(prompt_speech)]`;
the modes differ only in the two prompt parts (the flow always gets the voice's prompt tokens, mel and
CAM++ embedding):

| mode          | prompt_text                          | prompt speech        |
|---------------|--------------------------------------|----------------------|
| zero-shot     | the voice's transcript               | the voice's tokens   |
| cross-lingual | none (voice registered w/o transcript)| none                |
| instruct2     | instruction + `<|endofprompt|>`      | none                 |
| sft           | none                                 | none                 |

Fine-grained tags (`[laughter]`, `[breath]`, `<strong>…</strong>`, ...) need no mode: they are special
tokens of the tokenizer (`text.V2_SPECIAL_TOKENS`) and are encoded as single ids where they appear in the
text, as the reference's `allowed_special='all'` does. Pure functions; any thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from voicertc.backends.cosyvoice.voice.text import ENDOFPROMPT
from voicertc.backends.cosyvoice.voice.voices import Voice
from voicertc.errors import InputError

Mode = Literal["zero_shot", "cross_lingual", "instruct", "sft"]
Segment = tuple[str, tuple[int, ...]]
MAX_INSTRUCT_CHARS = 500


@dataclass(frozen=True)
class LlmPrompt:
    """The prompt parts of one utterance's LLM input."""

    mode: Mode
    text_ids: tuple[int, ...]  # prompt text (transcript, or instruction + <|endofprompt|>); () for none
    speech_ids: tuple[int, ...]  # prompt speech tokens; () for none


def instruct_text(instruct: str) -> str:
    """The reference's instruct2 prompt: the instruction followed by `<|endofprompt|>` (added if absent)."""
    text = instruct.strip()
    if not text:
        raise InputError("the instruction is empty")
    if len(text) > MAX_INSTRUCT_CHARS:
        raise InputError(f"the instruction has {len(text)} characters; the limit is {MAX_INSTRUCT_CHARS}")
    return text if text.endswith(ENDOFPROMPT) else text + ENDOFPROMPT


def llm_prompt(
    voice: Voice, instruct: str = "", encode: Callable[[str], list[int]] | None = None
) -> LlmPrompt:
    """The LLM prompt of an utterance on `voice`, with an instruction (instruct2) or without."""
    if instruct:
        if encode is None:
            raise ValueError("an instruction needs the tokenizer's encode")
        return LlmPrompt("instruct", tuple(encode(instruct_text(instruct))), ())
    if voice.prompt_text_tokens:
        return LlmPrompt("zero_shot", tuple(voice.prompt_text_tokens), tuple(voice.llm_prompt_tokens))
    return LlmPrompt("sft" if voice.kind == "sft" else "cross_lingual", (), ())


def lm_input_segments(prompt: LlmPrompt, tts_text_ids: Sequence[int]) -> list[Segment]:
    """The LLM input in order (§3.2 step 1-2): sos, prompt text ⧺ tts text, task_id, prompt speech."""
    return [
        ("sos", ()),
        ("text", (*prompt.text_ids, *(int(t) for t in tts_text_ids))),
        ("task_id", ()),
        ("speech", prompt.speech_ids),
    ]
