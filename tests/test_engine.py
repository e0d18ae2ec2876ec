"""The engine worker seam: lifecycle, isolation, backpressure, bad input (on FakeEngine)."""

from __future__ import annotations

import threading

import pytest
from engine_helpers import EventLog, RecordingSink

from voicertc.config import FakeConfig
from voicertc.engine import Cancelled, Done, Failed, FirstAudio
from voicertc.engine.fake import FakeBackend, FakeEngine
from voicertc.engine.worker import EngineWorker
from voicertc.errors import EngineStoppedError, ModelDirError, UnknownVoiceError


@pytest.fixture
def engine():
    eng = FakeEngine(FakeConfig(ttfa_ms=5, rtf=0.0, chunk_ms=100), max_text_chars=5000)
    eng.start()
    yield eng
    eng.stop()
    assert not eng.running


def terminal(events):
    return [e for e in events if isinstance(e, (Done, Cancelled, Failed))]


def test_say_gives_first_audio_then_done(engine):
    log, sink = EventLog(), RecordingSink()
    uid = engine.say(None, sink, log, "Hello there, this is a test of the engine.")
    log.wait_terminal([uid])
    kinds = [type(e) for e in log.of(uid)]
    assert kinds == [FirstAudio, Done]
    assert sink.ended == [uid]
    done = log.of(uid)[-1]
    assert done.audio_ms == pytest.approx(1000 * len(sink.samples(uid)) / 24000)
    assert sink.samples(uid).std() > 0.1


def test_twenty_concurrent_utterances_each_get_one_terminal_event(engine):
    log = EventLog()
    sinks = [RecordingSink() for _ in range(20)]
    uids = [engine.say(None, s, log, f"Utterance number {i} says a few words.") for i, s in enumerate(sinks)]
    log.wait_terminal(uids)
    for uid, sink in zip(uids, sinks, strict=True):
        assert len(terminal(log.of(uid))) == 1
        assert isinstance(terminal(log.of(uid))[0], Done)
        assert len(sink.samples(uid)) > 0
    assert engine._open_count == 0


def test_cancel_mid_utterance_frees_state(engine):
    log, sink = EventLog(), RecordingSink(room_samples=2400)  # backpressure holds it mid-way
    uid = engine.say(None, sink, log, "A long sentence that would take several seconds to speak. " * 5)
    first = threading.Event()
    while not log.of(uid):
        first.wait(0.01)
    engine.cancel(uid)
    log.wait_terminal([uid])
    assert isinstance(terminal(log.of(uid))[0], Cancelled)
    # state is freed when the terminal event is sent, not only at shutdown
    assert uid not in engine._utterances and engine._open_count == 0
    assert sink.aborted == [uid] and sink.ended == []
    engine.cancel(uid)  # a second cancel of a finished utterance is harmless
    again = engine.say(None, RecordingSink(), log, "Next.")
    log.wait_terminal([again])
    assert len(terminal(log.of(uid))) == 1


class FailsOnSilence(FakeBackend):
    """Fails the `silence` voice's utterances on their third chunk; `tone` ones are fine."""

    def step(self, utt, now_s):
        if utt.voice == "silence" and utt.backend_state.chunks_done == 2:
            raise RuntimeError("boom in the middle of an utterance")
        return super().step(utt, now_s)


@pytest.mark.expected_errors("boom in the middle")
def test_failure_mid_utterance_leaves_a_concurrent_streaming_one_intact():
    eng = EngineWorker(FailsOnSilence(FakeConfig(ttfa_ms=0, rtf=0.05, chunk_ms=100)))
    eng.start()
    try:
        log = EventLog()
        good_sink, bad_sink = RecordingSink(), RecordingSink()
        good = eng.say("tone", good_sink, log, "A long utterance that keeps streaming for a while. " * 2)
        bad = eng.say("silence", bad_sink, log, "This one breaks after two chunks of audio, mid-way.")
        log.wait_terminal([good, bad])
        order = [e.utterance_id for e in log.events if isinstance(e, (Done, Failed))]
        assert order == [bad, good]  # the failure happened while `good` was still streaming
        assert isinstance(terminal(log.of(bad))[0], Failed) and "boom" in terminal(log.of(bad))[0].message
        assert bad_sink.aborted == [bad] and len(bad_sink.samples(bad)) == 2 * 2400
        done = terminal(log.of(good))[0]
        assert isinstance(done, Done) and good_sink.ended == [good]
        assert done.audio_ms == pytest.approx(1000 * len(good_sink.samples(good)) / 24000)
    finally:
        eng.stop()


def test_a_stopped_engine_refuses_new_utterances_and_cancels_open_ones():
    eng = FakeEngine(FakeConfig(ttfa_ms=0, rtf=0.0))
    with pytest.raises(EngineStoppedError):
        eng.say(None, RecordingSink(), EventLog(), "not started yet")
    eng.start()
    log, sink = EventLog(), RecordingSink(room_samples=2400)
    uid = eng.say(None, sink, log, "Held by backpressure. " * 10)
    with log.cond:
        assert log.cond.wait_for(lambda: bool(log.of(uid)), 5)
    eng.stop()
    assert [type(e) for e in terminal(log.of(uid))] == [Cancelled]
    with pytest.raises(EngineStoppedError, match="not running"):
        eng.say(None, sink, log, "too late")
    assert eng._open_count == 0


def test_a_lazy_backend_is_built_on_the_worker_thread():
    built_on: list[str] = []

    def factory():
        built_on.append(threading.current_thread().name)
        return FakeBackend(FakeConfig(ttfa_ms=0))

    eng = EngineWorker(backend_factory=factory, name="fake")
    assert eng.voices() == []
    eng.start()
    try:
        assert built_on == ["voicertc-fake"] and "tone" in eng.voices()
    finally:
        eng.stop()


def test_a_backend_load_error_is_raised_by_start():
    def factory():
        raise ModelDirError("llm.pt: truncated file")

    eng = EngineWorker(backend_factory=factory, name="broken")
    with pytest.raises(ModelDirError, match="llm.pt"):
        eng.start()
    assert not eng.running
    with pytest.raises(EngineStoppedError):
        eng.say(None, RecordingSink(), EventLog(), "hello")


@pytest.mark.expected_errors("fake engine failure")
def test_failing_utterance_leaves_a_concurrent_one_intact():
    eng = FakeEngine(FakeConfig(ttfa_ms=0, rtf=0.0, chunk_ms=100, fail_after_chunks=3))
    eng.start()
    try:
        log = EventLog()
        ok_sink, bad_sink = RecordingSink(), RecordingSink()
        ok = eng.say(None, ok_sink, log, "Hi.")  # 2 chunks: finishes before the failure point
        bad = eng.say(None, bad_sink, log, "This one is long enough to need more than three chunks.")
        log.wait_terminal([ok, bad])
        assert isinstance(terminal(log.of(ok))[0], Done)
        failed = terminal(log.of(bad))[0]
        assert isinstance(failed, Failed) and failed.code == "synthesis_error"
        assert "after 3 chunks" in failed.message
        again = eng.say(None, ok_sink, log, "Still alive.")  # the worker keeps serving
        log.wait_terminal([again])
    finally:
        eng.stop()


def test_backpressure_resumes_when_sink_drains(engine):
    log, sink = EventLog(), RecordingSink(room_samples=4800)
    uid = engine.say(None, sink, log, "Words " * 40)
    written = 0
    while not terminal(log.of(uid)):
        with log.cond:
            log.cond.wait(0.05)
        written += sink.queued()
        assert sink.queued() <= 4800 + 2400  # never more than the mark plus one piece
        sink.drain()
    assert isinstance(terminal(log.of(uid))[0], Done)
    assert written > 4800


def test_empty_text_is_an_error_event(engine):
    log, sink = EventLog(), RecordingSink()
    uid = engine.say(None, sink, log, "   ")
    log.wait_terminal([uid])
    event = terminal(log.of(uid))[0]
    assert isinstance(event, Failed) and event.code == "bad_input" and "empty" in event.message


def test_punctuation_or_emoji_only_is_done_without_audio(engine):
    log, sink = EventLog(), RecordingSink()
    uids = [engine.say(None, sink, log, text) for text in ("?!... --", "\U0001f600\U0001f389")]
    log.wait_terminal(uids)
    for uid in uids:
        assert [type(e) for e in log.of(uid)] == [Done]
        assert log.of(uid)[0].audio_ms == 0
        assert len(sink.samples(uid)) == 0


def test_unknown_voice_names_it(engine):
    with pytest.raises(UnknownVoiceError, match="nobody"):
        engine.say("nobody", RecordingSink(), EventLog(), "hello")


def test_text_over_the_limit_fails_with_a_clear_error(engine):
    log, sink = EventLog(), RecordingSink()
    uid = engine.say(None, sink, log, "x" * 6000)
    log.wait_terminal([uid])
    event = terminal(log.of(uid))[0]
    assert isinstance(event, Failed) and "too long" in event.message


def test_streamed_deltas_start_before_input_ends(engine):
    log, sink = EventLog(), RecordingSink()
    uid = engine.open_utterance(None, sink, log)
    for word in "Hello there, my friend. This text arrives word by word ".split(" "):
        engine.push_text(uid, word + " ")
    with log.cond:
        assert log.cond.wait_for(lambda: any(isinstance(e, FirstAudio) for e in log.events), 5)
    assert not terminal(log.of(uid))
    engine.end_input(uid)
    log.wait_terminal([uid])
    assert isinstance(terminal(log.of(uid))[0], Done)


def test_utterances_on_one_sink_play_in_order(engine):
    log, sink = EventLog(), RecordingSink()
    order: list[str] = []
    original = sink.write

    def recording_write(pcm, rate, uid, gen):
        if not order or order[-1] != uid:
            order.append(uid)
        return original(pcm, rate, uid, gen)

    sink.write = recording_write
    uids = [engine.say(None, sink, log, f"Sentence {i} is here with words.") for i in range(3)]
    log.wait_terminal(uids)
    assert order == uids


def test_a_cleared_sink_cancels_its_utterance(engine):
    log, sink = EventLog(), RecordingSink(room_samples=2400)
    uid = engine.say(None, sink, log, "Long text. " * 30)
    with log.cond:
        assert log.cond.wait_for(lambda: bool(log.of(uid)), 5)
    sink.clear()  # interrupt at the sink, before the engine hears of it
    sink.drain()
    log.wait_terminal([uid])
    assert isinstance(terminal(log.of(uid))[0], Cancelled)
