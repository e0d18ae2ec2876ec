"""CosyVoice2 text frontend: tokenizer special ids, normalisation, split_paragraph, incremental splitting."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.make_full_model_dir import QWEN_BASE_SPECIALS, write_tiny_tokenizer
from voicertc.backends.cosyvoice.voice.text import (
    V2_SPECIAL_TOKENS,
    SentenceStream,
    TextFrontend,
    TextTokenizer,
    normalize_zh,
    replace_blank,
    spell_out_numbers,
    split_paragraph,
    text_normalize,
)
from voicertc.errors import ModelDirError

BASE_SPECIALS = QWEN_BASE_SPECIALS


def write_tiny_qwen_tokenizer(out: Path) -> int:
    """A byte-level BPE in the CosyVoice-BlankEN file layout; returns the base size incl. specials."""
    return write_tiny_tokenizer(out)


@pytest.fixture(scope="module")
def blanken(tmp_path_factory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("tok") / "CosyVoice-BlankEN"
    return path, write_tiny_qwen_tokenizer(path)


def test_special_tokens_take_consecutive_ids_after_base_vocab(blanken):
    path, base = blanken
    tok = TextTokenizer(path)
    new = [t for t in V2_SPECIAL_TOKENS if t not in BASE_SPECIALS]
    assert len(new) == 17
    assert tok.endofprompt_id == base  # the analogue of 151646 in the real vocab
    assert tok.hf.convert_tokens_to_ids(new) == list(range(base, base + 17))
    assert tok.hf.convert_tokens_to_ids(BASE_SPECIALS[1:]) == [base - 2, base - 1]
    assert len(tok) == base + 17


def test_encode_recognises_special_tokens_and_adds_nothing(blanken):
    tok = TextTokenizer(blanken[0])
    ids = tok.encode("hello<|endofprompt|>world [breath]")
    assert tok.endofprompt_id in ids
    assert tok.hf.convert_tokens_to_ids("[breath]") in ids
    assert tok.encode("hello") == tok.hf.encode("hello", add_special_tokens=False)
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_missing_tokenizer_files_name_the_file(tmp_path):
    (tmp_path / "CosyVoice-BlankEN").mkdir()
    with pytest.raises(ModelDirError, match="vocab.json"):
        TextTokenizer(tmp_path / "CosyVoice-BlankEN")
    frontend = TextFrontend(tmp_path / "CosyVoice-BlankEN")  # lazy: builds fine
    with pytest.raises(ModelDirError, match="vocab.json"):
        frontend.encode("hi")


def _words(text: str) -> list[str]:
    return text.split()


def test_split_paragraph_small_limits_flush_and_merge():
    text = "一二三。四五六！七八九"  # no final terminator: '。' is appended
    assert split_paragraph(text, len, "zh", 5, 3, 2) == ["一二三。", "四五六！", "七八九。"]
    assert split_paragraph(text, len, "zh", 5, 3, 5) == ["一二三。", "四五六！七八九。"]
    assert split_paragraph(text, len, "zh") == ["一二三。四五六！七八九。"]


def test_split_paragraph_needs_strictly_more_than_min_before_flushing():
    sentences = [" ".join(["w"] * 29) + f" s{i}." for i in range(4)]  # 30 words each
    text = " ".join(sentences)
    chunks = split_paragraph(text, _words, "en")
    # 30, 60 (<= 80), 90 (> 80 but 60 is not > 60: kept), then 120 > 80 with 90 > 60: flush
    assert [len(c.split()) for c in chunks] == [90, 30]
    assert "".join(chunks) == text


def test_split_paragraph_short_remainder_joins_previous():
    text = " ".join(["a"] * 85) + ". end now."
    assert split_paragraph(text, _words, "en") == [text]
    text2 = " ".join(["a"] * 61) + ". " + " ".join(["b"] * 25) + ". tail."
    chunks = split_paragraph(text2, _words, "en")
    assert chunks == [" ".join(["a"] * 61) + ".", " " + " ".join(["b"] * 25) + ". tail."]


def test_split_paragraph_quotes_and_empty_terminators():
    assert split_paragraph('He said "hi." Then left', _words, "en") == ['He said "hi." Then left.']
    assert split_paragraph('He said "hi." Then left', _words, "en", 2, 1, 1) == [
        'He said "hi."',
        " Then left.",
    ]
    assert split_paragraph("他说“好。”然后走了", len, "zh", 3, 2, 1) == ["他说“好。”", "然后走了。"]
    assert split_paragraph("Wow!! Ok.", _words, "en", 1, 0, 0) == ["Wow!", " Ok."]
    assert split_paragraph("一、二、三", len, "zh", 2, 1, 1) == ["一、", "二、", "三。"]
    assert split_paragraph("a: b", _words, "en", 1, 0, 0) == ["a:", " b."]


def test_replace_blank_keeps_spaces_between_ascii_only():
    assert replace_blank("你好 世界 hello world 再见") == "你好世界hello world再见"
    assert replace_blank(" a b ") == "a b"


def test_spell_out_numbers_every_digit_run():
    assert spell_out_numbers("7 cats and 42 dogs") == "seven cats and forty-two dogs"
    assert spell_out_numbers("no digits") == "no digits"


def test_normalize_zh_cleanups():
    out = normalize_zh("价格是25元（含税）——很好，")
    assert not any(c.isdigit() for c in out)
    assert "（" not in out and "——" not in out
    assert out.endswith("。")


def test_text_normalize_paths(blanken):
    tok = TextTokenizer(blanken[0])
    special = "You are helpful.<|endofprompt|>I have 3 cats"
    assert text_normalize(special, tok.encode) == [special]
    assert text_normalize("", tok.encode) == [""]
    en = text_normalize("I have 23 apples", tok.encode)
    assert len(en) == 1 and "twenty" in en[0] and not any(c.isdigit() for c in en[0])
    assert en[0].endswith(".")
    zh = text_normalize("我有3个苹果", tok.encode)
    assert zh == ["我有三个苹果。"]
    assert text_normalize("—", tok.encode) == []


def test_sentence_stream_emits_when_next_char_arrives():
    stream = SentenceStream()
    assert stream.push("Hello there") == []
    assert stream.push(".") == []  # a quote could still follow
    assert stream.push(" How") == ["Hello there."]
    assert stream.push(" much is 3.") == []
    assert stream.push("5 dollars? Fine") == ["How much is 3.5 dollars?"]
    assert stream.push('! He said "ok."') == ["Fine!", 'He said "ok."']  # the quote closed it
    assert stream.push(" Bye") == []
    assert stream.flush() == ["Bye"]
    assert stream.flush() == []


def test_sentence_stream_chinese_and_punctuation_only():
    stream = SentenceStream()
    assert stream.push("你好。今天") == ["你好。"]
    assert stream.push("天气很好！！") == ["今天天气很好！"]
    assert stream.push("再见") == []
    assert stream.flush() == ["再见"]


def test_sentence_stream_concatenation_equals_input():
    text = "One. Two? Three! 四。五；six"
    for step in (1, 2, 5):
        stream = SentenceStream()
        out = []
        for i in range(0, len(text), step):
            out += stream.push(text[i : i + step])
        out += stream.flush()
        assert out == ["One.", "Two?", "Three!", "四。", "五；", "six"]


def test_word_stream_hands_on_complete_plain_words_with_their_space():
    stream = SentenceStream(words=True)
    assert stream.push("Sure") == []  # may still grow
    assert stream.push(", I can") == ["Sure, I"]  # "can" may still grow
    assert stream.push(" help") == [" can"]
    assert stream.push(" you. It costs $5") == [" help you.", " It costs"]
    assert stream.push(" million") == []  # "$5" waits: a number is normalised with what follows it
    assert stream.push(" a") == [" $5 million"]
    assert stream.push(" year ") == [" a year"]
    assert stream.push("ok") == []
    assert stream.flush() == [" ok"]


def test_word_stream_keeps_numbers_and_abbreviated_sentences_whole():
    stream = SentenceStream(words=True)
    assert stream.push("Pay 3.") == ["Pay"]
    assert stream.push("5 dollars") == []  # "3.5" was not cut at "."
    assert stream.push(" now!") == [" 3.5 dollars"]
    assert stream.push("  Bye") == [" now!"]
    assert stream.flush() == [" Bye"]


WORDS = [
    "Hello",
    "there,",
    "world!",
    "3.5",
    "$5",
    "Dr.",
    "it's",
    "co-op",
    "ok?",
    "你好。",
    "vingt-et-un",
    "12:30",
]


@given(
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=12),
    st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=40),
)
def test_word_stream_pieces_rebuild_the_text_whatever_the_delta_cuts(words, cuts):
    text = " ".join(words)
    stream = SentenceStream(words=True)
    out, i = [], 0
    for step in cuts:
        out += stream.push(text[i : i + step])
        i += step
    out += stream.push(text[i:])
    out += stream.flush()
    assert "".join(out) == text
    ends = set(itertools.accumulate(len(p) for p in out))
    for end in ends - {len(text)}:  # every cut is at a space, after a plain word or a sentence end
        assert text[end] == " "
        last = text[:end].split()[-1]
        assert re.fullmatch(r"[^\W\d_]+(?:['’\-][^\W\d_]+)*[,:]?", last) or last[-1] in ".!?;。", last


def test_a_streamed_piece_after_a_space_keeps_one_and_its_tokens_are_as_written():
    from voicertc.backends.cosyvoice.voice.text_prep import prepare_text

    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    assert prepare_text("  can help", encode, split=False).pieces[0][0] == " can help"
    assert prepare_text(" can help", encode, split=False).pieces[0][1] == tuple(encode(" can help"))
    assert prepare_text("Sure, I", encode, split=False).pieces[0][0] == "Sure, I"
    assert prepare_text(" 你好", encode, split=False).pieces[0][0] == "你好"  # Chinese joins without spaces
    whole = prepare_text(" Hello there.", encode, split=True).pieces
    assert [p for p, _ in whole] == ["Hello there."]  # a whole text is normalised as the official does
