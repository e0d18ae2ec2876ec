"""Clause-by-clause text chunking (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from voicertc.engine.text_chunks import has_speech, next_text_chunk


def chunks_of(text: str, **kw) -> list[str]:
    out, first = [], True
    while (split := next_text_chunk(text, input_ended=True, first=first, **kw)) is not None:
        chunk, text = split
        out.append(chunk)
        first = False
    return out


def test_first_chunk_is_the_shortest_sensible_clause():
    text = "Well, I think, that we should go home now. It is late. Very late indeed."
    assert chunks_of(text)[0] == "Well, I think,"


def test_later_chunks_are_whole_sentences():
    text = "Hi there, friend. One sentence here. Another one here. A third one."
    assert chunks_of(text) == ["Hi there, friend.", "One sentence here. Another one here. A third one."]


def test_streamed_text_waits_for_the_boundary_to_be_confirmed():
    assert next_text_chunk("The value is 3.", input_ended=False, first=False) is None
    assert next_text_chunk("The value is 3.5 today. And", input_ended=False, first=False) == (
        "The value is 3.5 today.",
        "And",
    )
    assert next_text_chunk("no boundary yet", input_ended=False, first=True) is None


def test_long_text_without_punctuation_is_cut_at_a_space():
    text = "word " * 200
    chunk, rest = next_text_chunk(text, input_ended=False, first=False, max_chars=300)
    assert len(chunk) <= 300 and chunk.endswith("word")


@given(st.text(alphabet=st.sampled_from("ab ,.!?\n"), max_size=400))
def test_chunking_keeps_every_word_in_order(text):
    chunks = chunks_of(text, max_chars=50)
    assert " ".join(chunks).split() == text.split()
    assert all(len(c) <= 50 for c in chunks)


def test_has_speech():
    assert has_speech("a") and has_speech("42")
    assert not has_speech("?!... --") and not has_speech("\U0001f600")
