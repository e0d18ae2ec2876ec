"""Bounded Piper work: phoneme pieces (pure) and, through the real engine, no synthesis call over the
configured piece size whatever the text (issue 11, finding 2: one call starved every other).

The bound is asserted in work units (phonemes per onnxruntime call), never in wall-clock time.
"""

from __future__ import annotations

import pytest
from engine_helpers import EventLog, RecordingSink

from voicertc.backends.phoneme_pieces import cut_index, piece_texts, split_phonemes
from voicertc.backends.piper import PiperBackend
from voicertc.engine import Done, Failed, FirstAudio
from voicertc.engine.worker import EngineWorker

PATHOLOGICAL = {
    "digits": "123456789012 " * 16,
    "currency": "$1,234,567.89 €9,876,543.21 £5,555,555.55 ¥123,456,789 " * 4,
    "math": "𝐀𝐁𝐂𝐃𝐄𝐅 𝑥𝑦𝑧 𝔸𝔹ℂ 𝕒𝕓𝕔 " * 10,
    "emoji": "Hello 😀 world 🎉 this 🚀 is 👍 fun 🔥 " * 6,
}
PIECE = 60


def phonemes(text: str) -> list[str]:
    return list(text)  # one character per phoneme is enough for the pure splitter


def squeeze(pieces: list[list[str]]) -> str:
    return "".join("".join(p) for p in pieces).replace(" ", "")


@pytest.mark.parametrize("limit", [1, 5, 12, 40])
def test_pieces_are_bounded_and_lose_nothing_but_gaps_at_cuts(limit):
    text = "wˈʌn hˈʌndɹɪd, twˈɛnti θɹˈiː bˈɪliən; lˌɛɾɚwˌʌndˌiːfˈɔːɹzˌiəɹoʊzˌiəɹoʊ sˈɪks"
    pieces = split_phonemes(phonemes(text), limit)
    assert all(1 <= len(p) <= limit for p in pieces)
    assert all(p[0] != " " and p[-1] != " " for p in pieces)
    assert squeeze(pieces) == text.replace(" ", "")


def test_cuts_prefer_clauses_then_words_then_syllables():
    clause = phonemes("ə bˈɪt lˈɔŋɚ, ðæn ðə ɹˈɛst ʌv ɪt hˈɪɹ")
    assert "".join(split_phonemes(clause, 24)[0]) == "ə bˈɪt lˈɔŋɚ,"
    words = phonemes("wˈʌn tˈuː θɹˈiː fˈɔːɹ fˈaɪv sˈɪks")
    assert "".join(split_phonemes(words, 16)[0]) == "wˈʌn tˈuː θɹˈiː"
    run = phonemes("lˌɛɾɚwˌʌndˌiːfˈɔːɹz")  # espeak's space-less run: cut before an onset + stress
    assert "".join(run[: cut_index(run, 12)]) == "lˌɛɾɚwˌʌn"  # before "dˌiː"
    assert cut_index(phonemes("abcdefghijkl"), 5) == 5  # nothing to prefer: a hard cut


def test_the_first_piece_has_its_own_limit():
    text = phonemes("wˈʌn tˈuː θɹˈiː fˈɔːɹ fˈaɪv sˈɪks sˈɛvən ˈeɪt nˈaɪn tˈɛn")
    pieces = split_phonemes(text, 30, first_max_phonemes=10)
    assert len(pieces[0]) <= 10 and all(len(p) <= 30 for p in pieces[1:])
    assert squeeze(pieces) == "".join(text).replace(" ", "")


@pytest.fixture(scope="module")
def bounded_engine():
    backend = PiperBackend(threads=1, piece_phonemes=PIECE)
    engine = EngineWorker(backend, max_utterance_s=15.0)  # the cap keeps the test short
    engine.start()
    yield engine
    engine.stop()


class CountingSession:
    """Wraps the onnxruntime session: phoneme ids per run (Piper: BOS, PAD, (id, PAD) per phoneme, EOS:
    at most 2 * phonemes + 3 ids)."""

    def __init__(self, session) -> None:
        self.session = session
        self.id_counts: list[int] = []

    def run(self, outputs, inputs, run_options=None):
        self.id_counts.append(int(inputs["input"].shape[1]))
        return self.session.run(outputs, inputs, run_options)


@pytest.mark.parametrize("name", list(PATHOLOGICAL))
def test_no_synthesis_call_exceeds_the_piece_size_whatever_the_text(bounded_engine, name):
    backend = bounded_engine.backend
    counting = CountingSession(backend._voice.session)
    backend._voice.session = counting
    try:
        log, sink = EventLog(), RecordingSink()
        uid = bounded_engine.say(None, sink, log, PATHOLOGICAL[name])
        log.wait_terminal([uid], timeout_s=120)
    finally:
        backend._voice.session = counting.session
    events = log.of(uid)
    assert isinstance(events[0], FirstAudio)
    assert isinstance(events[-1], Done | Failed)
    if isinstance(events[-1], Failed):
        assert events[-1].code == "utterance_too_long"
    assert counting.id_counts, "nothing was synthesized"
    assert max(counting.id_counts) <= 2 * PIECE + 3
    assert counting.id_counts[0] <= 2 * backend.first_piece_phonemes + 3
    assert len(sink.samples(uid)) > 22050  # it did speak


def test_the_first_piece_of_an_utterance_is_short_for_time_to_first_audio(bounded_engine):
    backend = bounded_engine.backend
    pieces = backend.pieces(PATHOLOGICAL["digits"], first=True)
    assert len(pieces[0]) <= backend.first_piece_phonemes <= PIECE
    assert all(len(p) <= PIECE for p in pieces)
    assert sum(len(p) for p in pieces) > 1000  # 208 characters, over a thousand phonemes


def test_a_step_synthesizes_one_piece(bounded_engine):
    backend = bounded_engine.backend
    log, sink = EventLog(), RecordingSink()
    uid = bounded_engine.say(None, sink, log, PATHOLOGICAL["currency"])
    log.wait_terminal([uid], timeout_s=120)
    assert bounded_engine.step_stats.steps > 0
    done_or_failed = log.of(uid)[-1]
    assert isinstance(done_or_failed, Failed) and done_or_failed.code == "utterance_too_long"
    assert backend.piece_phonemes == PIECE


def test_piece_texts_cover_every_word_once_in_order():
    text = "One  hundred twenty three, and   then some more words here."
    pieces = [list("a" * 10), list("b" * 25), list("c" * 5), list("d" * 30)]
    texts = piece_texts(text, pieces)
    assert len(texts) == 4
    assert " ".join(t for t in texts if t).split() == text.split()
    assert all(t == t.strip() for t in texts)
    assert piece_texts("Hi.", [list("hˈaɪ.")]) == ["Hi."]
    assert piece_texts("", [list("ab")]) == [""]
