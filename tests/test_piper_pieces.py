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


def test_pieces_are_sized_from_max_step_ms_by_a_timed_calibration(monkeypatch):
    import voicertc.backends.piper as piper

    monkeypatch.setattr(piper, "_timed", lambda run, clock: 0.064)  # 64 phonemes in 64 ms: 1 ms each
    backend = PiperBackend(threads=1, max_step_ms=200)
    assert backend.piece_phonemes == int(piper.STEP_FILL * 200)  # 120 phonemes fill 60 % of 200 ms
    assert backend.first_piece_phonemes == piper.FIRST_PIECE_PHONEMES
    monkeypatch.setattr(piper, "_timed", lambda run, clock: 10.0)  # a hopeless machine: the floor
    assert PiperBackend(threads=1, max_step_ms=50).piece_phonemes == piper.MIN_PIECE_PHONEMES


def test_the_config_reaches_the_piper_engine():
    from voicertc.assemble import create_engine
    from voicertc.config import config_from_dict

    config = config_from_dict(
        {"engine": {"backend": "piper", "piper_piece_phonemes": 50}, "limits": {"max_utterance_s": 30}}
    )
    engine = create_engine(config)
    engine.start()
    try:
        assert engine.backend.piece_phonemes == 50
        assert engine.max_utterance_s == 30.0 and engine.step_stats.max_step_ms == 200
    finally:
        engine.stop()


def test_a_new_utterance_waits_for_at_most_one_piece_of_a_pathological_one(bounded_engine):
    """Finding 2's mechanism, in work units: call B's 1,400-phoneme text no longer runs as one step
    that call A waits behind. A's request arrives right after B's first audio; before A's first
    synthesis call, B has synthesized at most its first piece and one more."""
    backend = bounded_engine.backend
    runs: list[tuple[str, int]] = []  # (utterance of the batch, phoneme ids in the onnxruntime call)
    batch_of = [""]
    original_batch, original_session = bounded_engine._run_batch, backend._voice.session

    def run_batch(batch):
        batch_of[0] = batch[0].utt.utterance_id
        original_batch(batch)

    class Session:
        def run(self, outputs, inputs, run_options=None):
            runs.append((batch_of[0], int(inputs["input"].shape[1])))
            return original_session.run(outputs, inputs, run_options)

    log_a, sink_a = EventLog(), RecordingSink()
    log_b, sink_b = EventLog(), RecordingSink()
    a_id: list[str] = []

    def on_b(event):  # engine thread: A's request lands while B is in the middle of its text
        log_b(event)
        if isinstance(event, FirstAudio):
            a_id.append(bounded_engine.say(None, sink_a, log_a, "Hello there, how are you?"))

    bounded_engine._run_batch, backend._voice.session = run_batch, Session()
    try:
        b = bounded_engine.say(None, sink_b, on_b, PATHOLOGICAL["digits"])
        log_b.wait_terminal([b], timeout_s=120)
        log_a.wait_terminal(a_id, timeout_s=120)
    finally:
        bounded_engine._run_batch, backend._voice.session = original_batch, original_session
    first_a = next(i for i, (uid, _) in enumerate(runs) if uid == a_id[0])
    b_ids_before_a = sum(ids for uid, ids in runs[:first_a] if uid == b)
    assert b_ids_before_a <= (2 * backend.first_piece_phonemes + 3) + (2 * PIECE + 3), runs
    assert any(uid == b for uid, _ in runs[first_a + 1 :])  # B was far from done: A cut in
