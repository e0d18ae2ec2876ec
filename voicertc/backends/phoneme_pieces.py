"""Bounded phoneme pieces: the unit of work of one Piper synthesis call (pure functions).

Why: normalisation expands short texts enormously ("123456789012 " * 16 is 208 characters and 1,422
phonemes, 70 s of speech), and a VITS call costs time and memory that grow with its input (superlinearly:
1,422 phonemes took 18 s and 1.5 GB at once). Each synthesis call therefore gets at most `max_phonemes`
phonemes of one sentence, so an engine step stays within `[engine] max_step_ms` whatever the text.

Where to cut, best first: after clause punctuation (`,` `;` `:`) — the voice pauses there anyway; at a
word boundary (a space); before a stress mark (a syllable start, for the long space-less runs espeak
makes of mathematical letters; espeak puts the mark before the vowel, so the cut moves back over one
onset consonant); anywhere. A cut is only taken if it keeps a piece at least a fraction
of the limit long, so prosody is not chopped into tiny bits.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

CLAUSE_MARKS = frozenset(",;:")
WORD_GAP = " "
STRESS_MARKS = frozenset("ˈˌ")
VOWELS = frozenset("aeiouyæøœɐɑɒɔəɘɚɛɜɞɤɨɪɯɵʉʊʌʏː")
# A cut at a weaker boundary is taken only past this fraction of the limit (clause, word, syllable).
MIN_FILL = (0.5, 0.3, 0.3)


def split_phonemes(
    phonemes: Sequence[str], max_phonemes: int, *, first_max_phonemes: int | None = None
) -> list[list[str]]:
    """Cut one sentence's phonemes into pieces of at most `max_phonemes` (the first piece at most
    `first_max_phonemes`, when given). Word gaps at the cuts are dropped; nothing else is."""
    limit = first_max_phonemes or max_phonemes
    if min(limit, max_phonemes) < 1:
        raise ValueError("piece limits must be >= 1")
    pieces: list[list[str]] = []
    rest = _strip(list(phonemes))
    while len(rest) > limit:
        cut = cut_index(rest, limit)
        piece, rest = _strip(rest[:cut]), _strip(rest[cut:])
        if piece:
            pieces.append(piece)
        limit = max_phonemes
    if rest:
        pieces.append(rest)
    return pieces


def cut_index(phonemes: Sequence[str], max_phonemes: int) -> int:
    """Where to end the next piece of `phonemes` (longer than `max_phonemes`): 1..max_phonemes."""
    window = phonemes[: max_phonemes + 1]  # a cut at max_phonemes may look at the phoneme after it
    clause = [i + 1 for i in range(len(window) - 1) if window[i] in CLAUSE_MARKS and i + 1 <= max_phonemes]
    word = [i for i in range(1, len(window)) if window[i] == WORD_GAP]
    syllable = [_onset(window, i) for i in range(1, len(window)) if window[i] in STRESS_MARKS]
    for candidates, fill in zip((clause, word, syllable), MIN_FILL, strict=True):
        good = [i for i in candidates if fill * max_phonemes <= i <= max_phonemes]
        if good:
            return good[-1]
    return max_phonemes


def piece_texts(text: str, pieces: Sequence[Sequence[str]]) -> list[str]:
    """The words of `text` each piece speaks (for heard_text), by phoneme share: piece i gets the
    words whose position in `text` matches its position in the phonemes. Approximate inside a chunk;
    together the pieces' texts are every word of `text`, in order, each exactly once."""
    words = list(re.finditer(r"\S+", text))
    total = sum(len(piece) for piece in pieces) or 1
    texts: list[str] = []
    spoken_phonemes, first_word = 0, 0
    for i, piece in enumerate(pieces):
        spoken_phonemes += len(piece)
        end_word = len(words) if i == len(pieces) - 1 else round(len(words) * spoken_phonemes / total)
        end_word = max(end_word, first_word)  # rounding never goes back
        spans = words[first_word:end_word]
        texts.append(text[spans[0].start() : spans[-1].end()] if spans else "")
        first_word = end_word
    return texts


def _onset(phonemes: Sequence[str], stress_index: int) -> int:
    """The start of the syllable whose stress mark is at `stress_index` (back over one consonant)."""
    before = phonemes[stress_index - 1]
    if stress_index >= 2 and before not in VOWELS and before != WORD_GAP and before not in STRESS_MARKS:
        return stress_index - 1
    return stress_index


def _strip(phonemes: list[str]) -> list[str]:
    start, end = 0, len(phonemes)
    while start < end and phonemes[start] == WORD_GAP:
        start += 1
    while end > start and phonemes[end - 1] == WORD_GAP:
        end -= 1
    return phonemes[start:end]
