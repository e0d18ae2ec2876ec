"""Barge-in policy: off / speech / words, backchannels never cut, at most once per segment (pure)."""

from __future__ import annotations

import pytest

from voicertc.config import DEFAULT_BACKCHANNELS
from voicertc.listen.bargein import BargeInPolicy, has_content_word


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def policy(mode: str, playing: list[str | None]) -> tuple[BargeInPolicy, Clock]:
    clock = Clock()
    return BargeInPolicy(mode, DEFAULT_BACKCHANNELS, lambda: playing[0], clock), clock


@pytest.mark.parametrize(
    "text, content",
    [
        ("Yeah.", False),
        ("Okay.", False),
        ("Mm-hmm.", False),
        ("Uh-huh, yeah, right.", False),
        ("yeah yeah yeah", False),
        ("I see.", False),
        ("", False),
        ("...", False),
        ("Wait, what time is it?", True),
        ("Yeah, but what about Tuesday?", True),
        ("Okay stop", True),
    ],
)
def test_content_words(text, content):
    assert has_content_word(text, DEFAULT_BACKCHANNELS) is content


def test_off_never_cuts():
    p, _ = policy("off", ["u1"])
    assert p.speech_started(0.0) is None
    assert p.transcript(1, "stop talking please", final=False) is None


def test_speech_cuts_on_onset_while_playing_once_per_segment():
    playing: list[str | None] = ["u1"]
    p, clock = policy("speech", playing)
    clock.now = 101.5
    decision = p.speech_started(1234.0)
    assert decision is not None and decision.reason == "speech"
    assert decision.onset_ms == 1234.0 and decision.decided_s == 101.5 and decision.segment == 1
    playing[0] = "u2"
    assert p.transcript(1, "hello there", final=True) is None  # speech mode ignores words
    p.speech_stopped()
    assert p.speech_started(5000.0) is not None  # a new segment may cut again
    assert len(p.decisions) == 2


def test_speech_while_the_agent_is_silent_cuts_nothing():
    playing: list[str | None] = [None]
    p, _ = policy("speech", playing)
    assert p.speech_started(0.0) is None


def test_words_ignores_backchannels_and_cuts_on_a_question():
    playing: list[str | None] = ["u1"]
    p, _ = policy("words", playing)
    assert p.speech_started(0.0) is None  # onset alone never cuts in words mode
    assert p.transcript(1, "Yeah.", final=False) is None
    p.speech_stopped()
    assert p.transcript(1, "Yeah.", final=True) is None
    assert p.ignored_backchannels == 1
    p.speech_started(3000.0)
    assert p.transcript(2, "What", final=False) is not None
    assert p.decisions[-1].reason == "words" and p.decisions[-1].text == "What"
    assert p.transcript(2, "What time is it?", final=True) is None  # once per segment


def test_a_late_transcript_never_cuts_a_reply_queued_after_the_caller_stopped():
    playing: list[str | None] = [None]
    p, _ = policy("words", playing)
    p.speech_started(0.0)
    p.speech_stopped()
    playing[0] = "reply"  # the agent answered the question
    assert p.transcript(1, "What time is it?", final=True) is None


def test_a_late_final_still_cuts_what_the_caller_talked_over():
    playing: list[str | None] = ["u1"]
    p, _ = policy("words", playing)
    p.speech_started(0.0)
    p.speech_stopped()
    assert p.transcript(1, "Stop, please.", final=True) is not None


def test_a_transcript_of_an_old_segment_is_ignored():
    playing: list[str | None] = ["u1"]
    p, _ = policy("words", playing)
    p.speech_started(0.0)
    p.speech_stopped()
    p.speech_started(2000.0)
    assert p.transcript(1, "stop", final=True) is None


def test_bad_mode():
    with pytest.raises(ValueError):
        BargeInPolicy("loud", (), lambda: None)
