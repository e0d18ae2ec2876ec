"""Whisper work is bounded and follows its calls (issue 24, item 4): a queue with a limit whose oldest
final is dropped and reported (`user.transcript` with `"dropped": true`), a call's jobs cancelled when it
ends, several workers on one model. The real bundled Whisper (tiny.en) on real synthesized speech."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from listen_helpers import caller_clip, wer

from voicertc.config import ListenConfig, config_from_dict
from voicertc.errors import ConfigError
from voicertc.listen.listener import CallListener
from voicertc.listen.models import auto_workers, whisper_model
from voicertc.listen.transcriber import Transcriber, TranscriptJob

SENTENCE = "Please call me back tomorrow morning."


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    pcm, _ = caller_clip([0.2, SENTENCE, 0.2])
    return pcm.astype(np.float32)


class Results:
    """Callbacks of submitted jobs, by key, from the worker threads."""

    def __init__(self) -> None:
        self.texts: dict[tuple[str, int], str] = {}
        self.dropped: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.done = threading.Event()

    def job(self, call_id: str, segment: int, pcm: np.ndarray, expected: int) -> TranscriptJob:
        def on_text(text: str) -> None:
            with self.lock:
                self.texts[(call_id, segment)] = text
                if len(self.texts) + len(self.dropped) >= expected:
                    self.done.set()

        def on_dropped() -> None:
            with self.lock:
                self.dropped.append((call_id, segment))

        return TranscriptJob((call_id, segment), pcm, True, on_text, on_dropped)


def test_a_full_queue_drops_the_oldest_final_and_says_so(speech):
    transcriber = Transcriber(whisper_model(1, 1), workers=1, max_jobs=3)
    results = Results()
    try:
        for segment in range(12):  # far faster than Whisper: at most 3 wait, one runs
            transcriber.submit(results.job("call-a", segment, speech, expected=12))
        assert results.done.wait(120)
    finally:
        transcriber.stop()
    assert len(results.texts) + len(results.dropped) == 12
    assert len(results.dropped) >= 12 - 3 - 2 and transcriber.dropped == len(results.dropped)
    kept = sorted(results.texts)
    assert kept[-3:] == [("call-a", 9), ("call-a", 10), ("call-a", 11)]  # the newest survive
    assert all(wer(SENTENCE, results.texts[k]) < 0.5 for k in kept), results.texts


def test_an_ended_call_takes_its_waiting_jobs_along_and_others_go_on(speech):
    transcriber = Transcriber(whisper_model(1, 1), workers=1, max_jobs=50)
    results = Results()
    try:
        for segment in range(6):
            transcriber.submit(results.job("gone", segment, speech, expected=1))
        transcriber.submit(results.job("stays", 0, speech, expected=1))
        transcriber.cancel_call("gone")
        assert transcriber.pending() <= 1  # only "stays" may still wait
        for _ in range(600):
            if ("stays", 0) in results.texts:
                break
            threading.Event().wait(0.1)
    finally:
        transcriber.stop()
    assert ("stays", 0) in results.texts
    gone = [k for k in results.texts if k[0] == "gone"]
    assert gone in ([], [("gone", 0)])  # at most the one that was already running... and never reported after
    assert transcriber.cancelled >= 5


def test_two_workers_share_one_model_and_both_work(speech):
    transcriber = Transcriber(whisper_model(1, 2), workers=2, max_jobs=10)
    results = Results()
    seen: set[str] = set()
    original = transcriber.transcribe

    def recording(pcm, call_id=None):
        seen.add(threading.current_thread().name)
        return original(pcm, call_id)

    transcriber.transcribe = recording  # type: ignore[method-assign]
    try:
        for segment in range(6):
            transcriber.submit(results.job(f"call-{segment}", 0, speech, expected=6))
        assert results.done.wait(120)
    finally:
        transcriber.stop()
    assert transcriber.workers == 2 and len(results.texts) == 6
    assert seen == {"voicertc-whisper-0", "voicertc-whisper-1"}


async def test_a_dropped_transcript_reaches_the_caller_as_user_transcript_dropped():
    events: list[dict] = []
    listener = CallListener("call-x", ListenConfig(), events.append, lambda: None, lambda _d: None, None)
    listener._deliver("text", (1, "", True, 1200.0, 2400.0, True))
    listener._deliver("text", (2, "hello there", True, 3000.0, 3500.0))
    assert events == [
        {"type": "user.transcript", "text": "", "start_ms": 1200.0, "end_ms": 2400.0, "dropped": True},
        {"type": "user.transcript", "text": "hello there", "start_ms": 3000.0, "end_ms": 3500.0},
    ]
    assert listener.transcripts_dropped == 1 and listener.transcripts == 1
    await listener.close()


def test_workers_and_queue_are_configured_and_checked():
    assert auto_workers(3) == 3 and 1 <= auto_workers(0) <= 4
    config = config_from_dict({"listen": {"whisper_workers": 2, "transcript_queue": 4}})
    assert (config.listen.whisper_workers, config.listen.transcript_queue) == (2, 4)
    for key, bad in (("whisper_workers", -1), ("transcript_queue", 0)):
        with pytest.raises(ConfigError, match=f"listen.{key}"):
            config_from_dict({"listen": {key: bad}})
