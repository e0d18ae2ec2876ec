"""Pure text chunking for clause-by-clause synthesis (the Piper voice, the fake engine).

The first chunk is the shortest sensible clause, so first audio comes fast; later chunks are whole
sentences, merged up to a size that keeps each synthesis step bounded. With streamed text (LLM
deltas) a boundary counts only once the character after it has arrived, so "3." in "3.5" or a
sentence still being typed is never cut.
"""

from __future__ import annotations

import re

_CLAUSE_END = re.compile(r"(?:[,;:\u2014]|[.!?\u2026\u3002\uff01\uff1f]+)[\"'\u201d\u2019)\]]*(?=\s)")
_SENTENCE_END = re.compile(r"[.!?\u2026\u3002\uff01\uff1f]+[\"'\u201d\u2019)\]]*(?=\s)")
_WORDLIKE = re.compile(r"\w")


def has_speech(text: str) -> bool:
    """Whether `text` has anything to say (letters or digits; not only punctuation or emoji)."""
    return bool(_WORDLIKE.search(text))


def _boundaries(pattern: re.Pattern[str], text: str, input_ended: bool) -> list[int]:
    ends = [m.end() for m in pattern.finditer(text)]
    if input_ended and text.strip():
        ends.append(len(text))
    return ends


def next_text_chunk(
    text: str,
    *,
    input_ended: bool,
    first: bool,
    min_first_chars: int = 12,
    max_chars: int = 300,
) -> tuple[str, str] | None:
    """Split the next chunk off `text`: `(chunk, rest)`, or None when more text must arrive first."""
    if not text.strip():
        return None
    whole = len(text) <= max_chars
    window = text if whole else text[: max_chars + 1]  # boundaries beyond max_chars never matter
    input_ended = input_ended and whole
    text_all, text = text, window
    if first:
        for end in _boundaries(_CLAUSE_END, text, input_ended):
            if len(text[:end].strip()) >= min_first_chars or end == len(text):
                return _split(text_all, min(end, _hard_cut(text, max_chars)))
    else:
        ends = [e for e in _boundaries(_SENTENCE_END, text, input_ended) if e <= max_chars]
        if ends:
            return _split(text_all, ends[-1])
        clause_ends = [e for e in _boundaries(_CLAUSE_END, text, input_ended) if e <= max_chars]
        if not whole and clause_ends:
            return _split(text_all, clause_ends[-1])
    if not whole:
        return _split(text_all, _hard_cut(text, max_chars))
    return None


def _hard_cut(text: str, max_chars: int) -> int:
    """Where to cut text with no usable boundary: the last space before `max_chars`."""
    if len(text) <= max_chars:
        return len(text)
    space = text.rfind(" ", 0, max_chars)
    return space if space > 0 else max_chars


def _split(text: str, end: int) -> tuple[str, str]:
    return text[:end].strip(), text[end:].lstrip()
