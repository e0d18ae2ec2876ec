"""CosyVoice2 text frontend: Qwen2 tokenizer with the CosyVoice2 special tokens, normalisation, splitting.

Mirrors the official `CosyVoiceFrontEnd.text_normalize` without ttsfrd (cosyvoice.md §2.1-2.3): wetext
normalisation (Chinese / English), the Chinese clean-ups, English numbers spelled out with inflect, then
`split_paragraph` (each piece becomes its own LLM call). `SentenceStream` is the incremental splitter for
text that arrives as deltas (an LLM's output).
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import regex

from voicertc.errors import ModelDirError

logger = logging.getLogger(__name__)

# get_qwen_tokenizer(version='cosyvoice2'): added in this order; the first two exist in the base vocab.
V2_SPECIAL_TOKENS = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
)  # fmt: skip
ENDOFPROMPT = "<|endofprompt|>"
ENDOFPROMPT_ID = 151646  # hard-coded by the official LLM; holds for the real CosyVoice-BlankEN vocab
REAL_BASE_VOCAB_SIZE = 151646

ZH_TERMINATORS = ("。", "？", "！", "；", "：", "、", ".", "?", "!", ";")
EN_TERMINATORS = (".", "?", "!", ";", ":")
CLOSING_QUOTES = ('"', "”")
STREAM_TERMINATORS = ("。", "？", "！", "；", ".", "?", "!", ";")  # sentence ends, not clause marks
TOKEN_MAX_N, TOKEN_MIN_N, MERGE_LEN = 80, 60, 20
_ONLY_PUNCT = regex.compile(r"^[\p{P}\p{S}]*$")
_CJK = re.compile(r"[\u4e00-\u9fff]")


# ---- tokenizer --------------------------------------------------------------------------------------


class TextTokenizer:
    """`get_qwen_tokenizer(..., version='cosyvoice2')`: HF tokenizer + CosyVoice2 special tokens."""

    SPECIAL_TOKENS: tuple[str, ...] = V2_SPECIAL_TOKENS  # added in this order (CosyVoice3 adds more)

    def __init__(self, blanken_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        path = Path(blanken_dir)
        if not any((path / f).is_file() for f in ("tokenizer.json", "vocab.json")):
            raise ModelDirError(
                f"{path / 'vocab.json'}: text tokenizer files not found (vocab.json + merges.txt)"
            )
        try:
            self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelDirError(f"{path}: cannot load the text tokenizer ({exc})") from exc
        base_size = len(self.hf)
        self.hf.add_special_tokens(
            {
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "additional_special_tokens": list(self.SPECIAL_TOKENS),
            }
        )
        self.endofprompt_id = self.hf.convert_tokens_to_ids(ENDOFPROMPT)
        if base_size == REAL_BASE_VOCAB_SIZE and self.endofprompt_id != ENDOFPROMPT_ID:
            raise ModelDirError(
                f"{path}: {ENDOFPROMPT} got id {self.endofprompt_id}, expected {ENDOFPROMPT_ID}"
            )

    def __len__(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Token ids, special tokens in the text recognised, nothing added (no BOS/EOS)."""
        return list(self.hf([text])["input_ids"][0])

    def decode(self, ids: Sequence[int]) -> str:
        text = self.hf.decode(list(ids), skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text


# ---- normalisation ----------------------------------------------------------------------------------


def contains_chinese(text: str) -> bool:
    return bool(_CJK.search(text))


def is_only_punctuation(text: str) -> bool:
    return bool(_ONLY_PUNCT.match(text))


def replace_blank(text: str) -> str:
    """Drop spaces unless both neighbours are non-space ASCII (keeps 'hello world' inside Chinese)."""
    out = []
    for i, c in enumerate(text):
        if c != " ":
            out.append(c)
            continue
        before = text[i - 1] if i > 0 else ""
        after = text[i + 1] if i + 1 < len(text) else ""
        if before.isascii() and before not in ("", " ") and after.isascii() and after not in ("", " "):
            out.append(c)
    return "".join(out)


def remove_bracket(text: str) -> str:
    for c in ("（", "）", "【", "】", "`"):
        text = text.replace(c, "")
    return text.replace("——", " ")


@functools.cache
def _inflect() -> Any:
    try:
        import inflect
    except ImportError:
        logger.warning("inflect not installed: English numbers are left as digits")
        return None
    return inflect.engine()


def spell_out_numbers(text: str) -> str:
    """Every maximal run of digits (str.isdigit) as English words, as the official `spell_out_number`."""
    engine = _inflect()
    if engine is None:
        return text
    parts = []
    for is_digit, run in itertools.groupby(text, key=str.isdigit):
        chunk = "".join(run)
        parts.append(engine.number_to_words(chunk) if is_digit else chunk)
    return "".join(parts)


@functools.cache
def _wetext(lang: str) -> Any:
    try:
        from wetext import Normalizer
    except ImportError:
        logger.warning("wetext not installed: text is not normalised (numbers, dates, units)")
        return None
    if lang == "zh":
        return Normalizer(lang="zh", operator="tn", remove_erhua=False)
    return Normalizer(lang="en", operator="tn")


def _wetext_normalize(text: str, lang: str) -> str:
    normalizer = _wetext(lang)
    return text if normalizer is None else normalizer.normalize(text)


def normalize_zh(text: str) -> str:
    text = _wetext_normalize(text, "zh")
    text = replace_blank(text.replace("\n", ""))
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。").replace(" - ", "，")
    text = remove_bracket(text)
    return re.sub(r"[，,、]+$", "。", text)


def normalize_en(text: str) -> str:
    return spell_out_numbers(_wetext_normalize(text, "en"))


# ---- sentence splitting -----------------------------------------------------------------------------


def _pieces(text: str, terminators: Sequence[str]) -> list[str]:
    """Cut after each terminator; a closing quote right after one is glued to its piece."""
    pieces: list[str] = []
    start = 0
    for i, c in enumerate(text):
        if c not in terminators:
            continue
        if i > start:
            pieces.append(text[start:i] + c)
        start = i + 1
        if i + 1 < len(text) and text[i + 1] in CLOSING_QUOTES:
            if pieces:
                pieces[-1] += text[i + 1]
            start = i + 2
    return pieces


def split_paragraph(
    text: str,
    tokenize: Callable[[str], Sequence[int]],
    lang: str,
    token_max_n: int = TOKEN_MAX_N,
    token_min_n: int = TOKEN_MIN_N,
    merge_len: int = MERGE_LEN,
) -> list[str]:
    """Official `split_paragraph` (comma_split=False): sentences merged greedily into 60-80 unit chunks.

    Units are characters for 'zh' and tokens for 'en'. A terminator with nothing before it is dropped,
    as the official loop does; a final remainder shorter than `merge_len` joins the previous chunk.
    """
    if not text:
        return []
    terminators = ZH_TERMINATORS if lang == "zh" else EN_TERMINATORS

    def length(s: str) -> int:
        return len(s) if lang == "zh" else len(tokenize(s))

    if text[-1] not in terminators:
        text += "。" if lang == "zh" else "."
    chunks: list[str] = []
    current = ""
    for piece in _pieces(text, terminators):
        if length(current + piece) > token_max_n and length(current) > token_min_n:
            chunks.append(current)
            current = ""
        current += piece
    if current:
        if length(current) < merge_len and chunks:
            chunks[-1] += current
        else:
            chunks.append(current)
    return chunks


def text_normalize(text: str, tokenize: Callable[[str], Sequence[int]], split: bool = True) -> list[str]:
    """The official frontend's text path: normalised pieces, each one LLM call (not split: one piece)."""
    if ("<|" in text and "|>" in text) or not text:
        return [text]
    if contains_chinese(text):
        text = normalize_zh(text)
        lang = "zh"
    else:
        text = normalize_en(text)
        lang = "en"
    if not split:
        return [text]
    return [t for t in split_paragraph(text, tokenize, lang) if not is_only_punctuation(t)]


class TextFrontend:
    """Tokenizer + normalisation of one model directory; the tokenizer is built on first use."""

    tokenizer_class: type[TextTokenizer] = TextTokenizer

    def __init__(self, blanken_dir: str | Path) -> None:
        self.blanken_dir = Path(blanken_dir)
        self._tokenizer: TextTokenizer | None = None

    @property
    def tokenizer(self) -> TextTokenizer:
        if self._tokenizer is None:
            self._tokenizer = self.tokenizer_class(self.blanken_dir)
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def sentences(self, text: str) -> list[str]:
        """Normalised, split text: each entry is synthesised by its own LLM call."""
        return text_normalize(text, self.tokenizer.encode)

    def prompt_transcript(self, transcript: str) -> str:
        """A zero-shot prompt's transcript as the LLM prompt text holds it (v2: as written)."""
        return transcript


# ---- incremental splitting ----------------------------------------------------------------------------


# A word that may leave for the LLM before its sentence ends: letters only (any script), joined by
# apostrophes or hyphens, at most a comma or colon after it. A number, a symbol or an abbreviation keeps
# the text after it until another such word completes: it is normalised with what follows it ("$5
# million", "3 pm").
_PLAIN_WORD = re.compile(r"[^\W\d_]+(?:['’\-][^\W\d_]+)*[,:]?")
_SPACE_RUN = re.compile(r"\s+")


class SentenceStream:
    """Cuts text deltas into the pieces text-in streaming can use now; owned by one utterance.

    A sentence is emitted once the character after its terminator has arrived (so a quote can be glued
    and '3.5' is not cut at '.'); `flush()` returns the rest when the text stream ends. Pieces that are
    only punctuation are dropped.

    With `words=True` (the bistream LLM, which takes text 5 tokens at a time) the complete words of an
    unfinished sentence leave too: everything up to the last whitespace that follows a plain word
    (`_PLAIN_WORD`). Pieces then keep one leading space where the text had whitespace before them, so
    their tokens are those of the text as written ("Sure, I" + " can" tokenise as "Sure, I can").
    """

    def __init__(self, terminators: Sequence[str] = STREAM_TERMINATORS, words: bool = False) -> None:
        self.terminators = tuple(terminators)
        self.words = words
        self.buffer = ""
        self._emitted = False  # a piece has left: a later one keeps its leading space (words mode)

    def push(self, delta: str) -> list[str]:
        self.buffer += delta
        pieces = self._cut_sentences()
        if self.words:
            pieces += self._cut_words()
        return self._clean(pieces)

    def _cut_sentences(self) -> list[str]:
        out: list[str] = []
        start = 0
        i = 0
        while i < len(self.buffer) - 1:
            c, nxt = self.buffer[i], self.buffer[i + 1]
            if c in self.terminators and not (c == "." and nxt.isdigit()):
                end = i + 2 if nxt in CLOSING_QUOTES else i + 1
                out.append(self.buffer[start:end])
                start = end
                i = end
                continue
            i += 1
        self.buffer = self.buffer[start:]
        return out

    def _cut_words(self) -> list[str]:
        """The buffer up to its last whitespace run that follows a plain word (that word is complete)."""
        for space in reversed(list(_SPACE_RUN.finditer(self.buffer))):
            words = self.buffer[: space.start()].split()
            if words and _PLAIN_WORD.fullmatch(words[-1]):
                piece, self.buffer = self.buffer[: space.start()], self.buffer[space.start() :]
                return [piece]
        return []

    def _clean(self, pieces: list[str]) -> list[str]:
        out: list[str] = []
        for piece in pieces:
            body = piece.strip()
            if not body or is_only_punctuation(body):
                continue
            lead = " " if self.words and self._emitted and piece[:1].isspace() else ""
            out.append(lead + body)
            self._emitted = True
        return out

    def flush(self) -> list[str]:
        rest, self.buffer = self.buffer, ""
        return self._clean([rest])
