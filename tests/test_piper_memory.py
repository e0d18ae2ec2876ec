"""Bounded memory (issue 11, finding 1): speaking the pathological texts through the real Piper engine
leaves RSS where it was. Before the fix, "123456789012 " * 16 alone took the process from ~300 MB to
~1.6 GB, kept for good by onnxruntime's CPU arena.

RSS comes from /proc/self/statm; a sampler thread records the peak while the texts are spoken.
"""

from __future__ import annotations

import gc
import os
import threading

import pytest
from engine_helpers import EventLog, RecordingSink

from voicertc.backends.piper import PiperBackend
from voicertc.engine import Done, Failed
from voicertc.engine.worker import EngineWorker

PATHOLOGICAL = [
    "123456789012 " * 16,
    "$1,234,567.89 €9,876,543.21 £5,555,555.55 ¥123,456,789 " * 4,
    "𝐀𝐁𝐂𝐃𝐄𝐅 𝑥𝑦𝑧 𝔸𝔹ℂ 𝕒𝕓𝕔 " * 10,
    "Hello 😀 world 🎉 this 🚀 is 👍 fun 🔥 " * 6,
]
MB = 1024 * 1024
GROWTH_AFTER_MB = 50  # the bound for what one utterance may leave behind
PEAK_MB = 200  # while speaking: one bounded piece at a time (unbounded, a single call took 1.4 GB)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """Samples RSS every 10 ms on its own thread until stopped; keeps the peak."""

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def speak(engine: EngineWorker, text: str) -> None:
    log, sink = EventLog(), RecordingSink()
    uid = engine.say(None, sink, log, text)
    log.wait_terminal([uid], timeout_s=180)
    last = log.of(uid)[-1]
    assert isinstance(last, Done) or (isinstance(last, Failed) and last.code == "utterance_too_long"), last
    assert len(sink.samples(uid)) > 0


@pytest.fixture(scope="module")
def engine():
    # a cap keeps the test short; before the fix the whole text was one call, so the cap saved nothing
    eng = EngineWorker(PiperBackend(threads=1, piece_phonemes=64), max_utterance_s=40.0)
    eng.start()
    yield eng
    eng.stop()


def test_pathological_texts_leave_rss_where_it_was(engine):
    speak(engine, "A normal sentence first, so that everything that warms up has warmed up.")
    gc.collect()
    baseline = rss_bytes()
    with PeakSampler() as sampler:
        for text in PATHOLOGICAL:
            speak(engine, text)
            gc.collect()
            grown_mb = (rss_bytes() - baseline) / MB
            assert grown_mb <= GROWTH_AFTER_MB, f"RSS grew {grown_mb:.0f} MB after {text[:20]!r}"
    assert (sampler.peak - baseline) / MB <= PEAK_MB
    speak(engine, "And a normal sentence again, after all of that.")
    gc.collect()
    assert (rss_bytes() - baseline) / MB <= GROWTH_AFTER_MB
