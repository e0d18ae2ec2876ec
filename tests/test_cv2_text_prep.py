"""Text normalisation / tokenisation and voice features run off the engine thread (issue 24, item 2).

wetext holds the GIL while it verbalises (seconds for a long digit run), so the CosyVoice2 backend
hands text to spawned processes (`voice/text_prep.py`) and a registration's features are computed on
the worker's voice-preparation thread; the engine thread only installs the results. The properties
checked are measured ones: the preparation's own CPU time (reported by the process that did it)
against the longest GIL wait of a thread of this process, the engine's costliest step (its thread's
CPU time) and the gaps in another utterance's audio while it speaks.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
from cv2_engine_helpers import GOLDEN_VOICE, build_speaking_model_dir, load_speaking_model, make_backend
from engine_helpers import EventLog, RecordingSink

from voicertc.audio.decode import Clip
from voicertc.backends.cosyvoice.voice.text_prep import InlineTextPrep, ProcessTextPrep, prep_chunks
from voicertc.engine import Done, FirstAudio
from voicertc.engine.worker import EngineWorker
from voicertc.errors import InputError

torch.set_num_threads(1)

LONG_DIGITS = "我有" + "1234567890" * 500  # ~2 s of wetext CPU on the test VM, all under the GIL


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory):
    return load_speaking_model(
        build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("m"))
    )


@pytest.fixture(scope="module")
def engine(model, golden_dir, tmp_path_factory):
    """One text process; jobs as long as the whole digit text, so a stall would be one long one."""
    backend = make_backend(
        model, golden_dir, tmp_path_factory.mktemp("voices"), text_workers=1, prep_chars=len(LONG_DIGITS),
        max_segment_tokens=50,
    )  # fmt: skip
    worker = EngineWorker(backend, name="cv2-prep")
    worker.start()
    yield worker
    worker.stop()
    assert not worker.running


class GilProbe:
    """A thread that sleeps 2 ms at a time and records how late it woke: its longest wait is how long
    something else in this process held the GIL (or the loop would have stalled)."""

    def __init__(self) -> None:
        self.longest_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            self.longest_s = max(self.longest_s, now - last)
            last = now

    def __enter__(self) -> GilProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class TimedSink(RecordingSink):
    """A sink that notes when each piece of audio arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = [time.perf_counter()]

    def write(self, pcm, sample_rate_hz, utterance_id, generation) -> bool:
        self.times.append(time.perf_counter())
        return super().write(pcm, sample_rate_hz, utterance_id, generation)

    def longest_gap_s(self) -> float:
        return float(np.diff(self.times).max()) if len(self.times) > 1 else 0.0


def test_long_text_is_prepared_in_bounded_jobs_that_cover_it():
    text = ("Twelve apples cost 35 dollars. " * 60) + "1234567890" * 300
    chunks = prep_chunks(text, 500)
    assert len(chunks) > 5 and max(len(c) for c in chunks) <= 500
    assert "".join(chunks).replace(" ", "") == text.replace(" ", "")  # nothing lost, nothing reordered
    assert prep_chunks("Short one.", 500) == ["Short one."] and prep_chunks("  ", 500) == []


def test_the_process_pool_prepares_text_as_the_engine_thread_would(engine, model):
    backend = engine.backend
    pool = backend.text_prep
    assert isinstance(pool, ProcessTextPrep)
    inline = InlineTextPrep(model.text_frontend.encode)
    for text, split in [
        ("I have 3 apples and 25 pears. It is 10:30 now! Is it?", True),
        ("我有3个苹果。今天是2024年1月2日，气温-5度。", True),
        ("Hello there", False),
        ("...", True),
    ]:
        here, there = inline.submit(text, split).result(), pool.submit(text, split).result(30)
        assert there.pieces == here.pieces, text
        assert there.pid != os.getpid()  # really another process
    assert pool.submit("?!", True).result(30).pieces == ()


def test_a_long_digit_text_stalls_neither_the_process_nor_a_speaking_utterance(engine):
    engine.step_stats.longest_cpu_ms = 0.0
    log, digits_sink, speaking = EventLog(), RecordingSink(), TimedSink()
    talker = engine.open_utterance(GOLDEN_VOICE, speaking, log)
    engine.push_text(talker, "Hello there, this is another call speaking at the same time.", end=True)
    log.wait_for(talker, FirstAudio, 60)
    with GilProbe() as probe:
        speaking.times = [time.perf_counter()]  # its track's lag from now on
        digits = engine.open_utterance(GOLDEN_VOICE, digits_sink, log)
        engine.push_text(digits, LONG_DIGITS, end=True)
        log.wait_terminal([digits, talker], 180)
    done = {uid: log.of(uid)[-1] for uid in (digits, talker)}
    assert all(isinstance(e, Done) for e in done.values()), done
    prep_cpu_s = done[digits].metrics["text_prep_cpu_s"]  # measured by the process that did it
    assert prep_cpu_s > 0.4, "the digit text is too short to show a stall on this machine"
    assert digits_sink.samples(digits).size > 0
    # Inline, each of these would be at least the whole preparation (one job held the GIL throughout).
    assert probe.longest_s < prep_cpu_s / 2, (probe.longest_s, prep_cpu_s)
    assert engine.step_stats.longest_cpu_ms / 1000 < prep_cpu_s / 2, engine.step_stats.longest_cpu_ms
    assert speaking.longest_gap_s() < prep_cpu_s / 2, (speaking.longest_gap_s(), prep_cpu_s)


def _clip(seconds: float) -> Clip:
    rate = 16000
    t = np.arange(int(seconds * rate)) / rate
    wav = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return Clip(samples=wav.astype(np.float32), sample_rate_hz=rate)


def test_a_registration_computes_features_off_the_engine_thread_while_a_call_speaks(engine, model):
    extractor = model.speech_tokenizer
    threads: list[str] = []

    def probed(wav):  # the real speech tokenizer, noting the thread that runs it
        threads.append(threading.current_thread().name)
        return extractor(wav)

    model._speech_tokenizer = probed  # the model keeps its extractor here (built on first use)
    log, speaking = EventLog(), TimedSink()
    try:
        talker = engine.open_utterance(GOLDEN_VOICE, speaking, log)
        engine.push_text(talker, "Hello there, this call keeps speaking while a voice registers.", end=True)
        info = engine.register_voice(_clip(8.0), "Twenty three apples cost 45 dollars.", "probe", "").result(
            60
        )
        log.wait_terminal([talker], 120)
    finally:
        model._speech_tokenizer = extractor
    assert info["id"] == "probe" and "probe" in engine.voices()
    assert threads and all("voice-prep" in name for name in threads), threads
    assert isinstance(log.of(talker)[-1], Done)
    voice = engine.backend.book.get("probe")
    assert voice.prompt_text_tokens  # the transcript was tokenised (in a text process)
    spoken = EventLog()
    uid = engine.open_utterance("probe", RecordingSink(), spoken)
    engine.push_text(uid, "Now in the new voice.", end=True)
    spoken.wait_terminal([uid], 120)
    assert isinstance(spoken.of(uid)[-1], Done)


def test_an_overlong_transcript_is_refused_before_any_work(engine, model):
    extractor = model.speech_tokenizer
    calls: list[int] = []
    model._speech_tokenizer = lambda wav: calls.append(1) or extractor(wav)
    try:
        with pytest.raises(InputError, match="transcript has 19990 characters"):
            engine.register_voice(_clip(2.0), "1" * 19990, None, "long").result(30)
    finally:
        model._speech_tokenizer = extractor
    assert calls == []


def _speak(engine: EngineWorker, text: str) -> tuple[Done, np.ndarray]:
    log, sink = EventLog(), RecordingSink()
    uid = engine.open_utterance(GOLDEN_VOICE, sink, log, "same-id")  # same id: same seed, same tokens
    engine.push_text(uid, text, end=True)
    log.wait_terminal([uid], 180)
    done = log.of(uid)[-1]
    assert isinstance(done, Done), done
    return done, sink.samples(uid)


def test_text_prepared_in_a_process_speaks_exactly_as_prepared_inline(engine, model, golden_dir):
    text = "I have 3 apples. They cost 25 dollars, which is a lot! Do you agree?"
    inline = EngineWorker(make_backend(model, golden_dir, max_segment_tokens=50), name="cv2-inline")
    inline.start()
    try:
        _, expected = _speak(inline, text)
    finally:
        inline.stop()
    done, pooled = _speak(engine, text)
    assert done.metrics["text_prep_cpu_s"] > 0  # prepared by the text process
    assert expected.size > 0 and np.array_equal(pooled, expected)


def test_text_arriving_as_deltas_is_prepared_in_the_process_and_spoken(engine):
    deltas = ["I have 3 app", "les. They cost ", "25 dollars, which is a lot! ", "Do you agree?"]
    log, sink = EventLog(), RecordingSink()
    uid = engine.open_utterance(GOLDEN_VOICE, sink, log)
    for piece in deltas:
        engine.push_text(uid, piece)
    log.wait_for(uid, FirstAudio, 120)  # speech starts before the text ends (bistream)
    engine.end_input(uid)
    log.wait_terminal([uid], 180)
    done = log.of(uid)[-1]
    assert isinstance(done, Done), done
    assert done.metrics["text_prep_cpu_s"] > 0 and sink.samples(uid).size > 0


def test_inline_a_long_text_is_prepared_one_bounded_job_per_step(model, golden_dir):
    """`text_workers = 0`: the jobs run on the engine thread, but one per step (1,000 characters)."""
    engine = EngineWorker(make_backend(model, golden_dir, max_segment_tokens=20), name="cv2-inline-jobs")
    engine.start()
    try:
        log = EventLog()
        uid = engine.open_utterance(GOLDEN_VOICE, RecordingSink(), log)
        engine.push_text(uid, LONG_DIGITS, end=True)
        log.wait_terminal([uid], 180)
        done = log.of(uid)[-1]
        assert isinstance(done, Done), done
        assert done.metrics["text_prep_cpu_s"] > 0  # five jobs, all on the engine thread
        whole_s = InlineTextPrep(model.text_frontend.encode).submit(LONG_DIGITS, True).result().cpu_s
        longest_s = engine.step_stats.longest_cpu_ms / 1000
        assert longest_s < whole_s / 2, (longest_s, whole_s)  # the text as one job: one step of whole_s
    finally:
        engine.stop()
