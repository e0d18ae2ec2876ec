"""CosyVoice3 text frontend: CosyVoice2's (normalisation, splitting, HF tokenizer) with v3's special tokens.

`get_qwen_tokenizer(version='cosyvoice3')` adds 280 special tokens in this order after the base
vocabulary (the first two already exist in it): on the real CosyVoice-BlankEN vocabulary `<|endofprompt|>`
is 151646, `<|endofsystem|>` 151663, the phoneme tokens `[AA]`... follow up to 151923. CosyVoice3's LLM
requires `<|endofprompt|>` in the prompt text or the text: the zero-shot layout is
"<system prompt><|endofprompt|><transcript>".
"""

from __future__ import annotations

from voicertc.backends.cosyvoice.voice.text import ENDOFPROMPT, TextFrontend, TextTokenizer

V3_SPECIAL_TOKENS = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]", "<|endofsystem|>", "[AA]", "[AA0]",
    "[AA1]", "[AA2]", "[AE]", "[AE0]", "[AE1]", "[AE2]", "[AH]", "[AH0]", "[AH1]", "[AH2]", "[AO]",
    "[AO0]", "[AO1]", "[AO2]", "[AW]", "[AW0]", "[AW1]", "[AW2]", "[AY]", "[AY0]", "[AY1]", "[AY2]", "[B]",
    "[CH]", "[D]", "[DH]", "[EH]", "[EH0]", "[EH1]", "[EH2]", "[ER]", "[ER0]", "[ER1]", "[ER2]", "[EY]",
    "[EY0]", "[EY1]", "[EY2]", "[F]", "[G]", "[HH]", "[IH]", "[IH0]", "[IH1]", "[IH2]", "[IY]", "[IY0]",
    "[IY1]", "[IY2]", "[JH]", "[K]", "[L]", "[M]", "[N]", "[NG]", "[OW]", "[OW0]", "[OW1]", "[OW2]",
    "[OY]", "[OY0]", "[OY1]", "[OY2]", "[P]", "[R]", "[S]", "[SH]", "[T]", "[TH]", "[UH]", "[UH0]",
    "[UH1]", "[UH2]", "[UW]", "[UW0]", "[UW1]", "[UW2]", "[V]", "[W]", "[Y]", "[Z]", "[ZH]", "[a]", "[ai]",
    "[an]", "[ang]", "[ao]", "[b]", "[c]", "[ch]", "[d]", "[e]", "[ei]", "[en]", "[eng]", "[f]", "[g]",
    "[h]", "[i]", "[ian]", "[in]", "[ing]", "[iu]", "[ià]", "[iàn]", "[iàng]", "[iào]", "[iá]", "[ián]",
    "[iáng]", "[iáo]", "[iè]", "[ié]", "[iòng]", "[ióng]", "[iù]", "[iú]", "[iā]", "[iān]", "[iāng]",
    "[iāo]", "[iē]", "[iě]", "[iōng]", "[iū]", "[iǎ]", "[iǎn]", "[iǎng]", "[iǎo]", "[iǒng]", "[iǔ]", "[j]",
    "[k]", "[l]", "[m]", "[n]", "[o]", "[ong]", "[ou]", "[p]", "[q]", "[r]", "[s]", "[sh]", "[t]", "[u]",
    "[uang]", "[ue]", "[un]", "[uo]", "[uà]", "[uài]", "[uàn]", "[uàng]", "[uá]", "[uái]", "[uán]",
    "[uáng]", "[uè]", "[ué]", "[uì]", "[uí]", "[uò]", "[uó]", "[uā]", "[uāi]", "[uān]", "[uāng]", "[uē]",
    "[uě]", "[uī]", "[uō]", "[uǎ]", "[uǎi]", "[uǎn]", "[uǎng]", "[uǐ]", "[uǒ]", "[vè]", "[w]", "[x]",
    "[y]", "[z]", "[zh]", "[à]", "[ài]", "[àn]", "[àng]", "[ào]", "[á]", "[ái]", "[án]", "[áng]", "[áo]",
    "[è]", "[èi]", "[èn]", "[èng]", "[èr]", "[é]", "[éi]", "[én]", "[éng]", "[ér]", "[ì]", "[ìn]", "[ìng]",
    "[í]", "[ín]", "[íng]", "[ò]", "[òng]", "[òu]", "[ó]", "[óng]", "[óu]", "[ù]", "[ùn]", "[ú]", "[ún]",
    "[ā]", "[āi]", "[ān]", "[āng]", "[āo]", "[ē]", "[ēi]", "[ēn]", "[ēng]", "[ě]", "[ěi]", "[ěn]", "[ěng]",
    "[ěr]", "[ī]", "[īn]", "[īng]", "[ō]", "[ōng]", "[ōu]", "[ū]", "[ūn]", "[ǎ]", "[ǎi]", "[ǎn]", "[ǎng]",
    "[ǎo]", "[ǐ]", "[ǐn]", "[ǐng]", "[ǒ]", "[ǒng]", "[ǒu]", "[ǔ]", "[ǔn]", "[ǘ]", "[ǚ]", "[ǜ]",
)  # fmt: skip
ENDOFSYSTEM = "<|endofsystem|>"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


class TextTokenizerV3(TextTokenizer):
    """`get_qwen_tokenizer(..., version='cosyvoice3')`: HF tokenizer + the CosyVoice3 special tokens."""

    SPECIAL_TOKENS = V3_SPECIAL_TOKENS


class TextFrontendV3(TextFrontend):
    tokenizer_class = TextTokenizerV3

    def prompt_transcript(self, transcript: str) -> str:
        """v3: "<system><|endofprompt|><transcript>" unless it already holds `<|endofprompt|>` (an empty
        transcript stays empty, so it gets the v2 error)."""
        text = transcript.strip()
        return with_endofprompt(text) if text else transcript


def with_endofprompt(prompt_text: str, system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> str:
    """The v3 zero-shot prompt text: `prompt_text` unchanged if it already holds `<|endofprompt|>`, else
    "<system prompt><|endofprompt|><prompt_text>" (the layout of upstream's examples)."""
    if ENDOFPROMPT in prompt_text:
        return prompt_text
    return f"{system_prompt}{ENDOFPROMPT}{prompt_text}"
