"""The scheduler's pick (pure): starving playback first, then first audio, then the emptiest sink."""

from __future__ import annotations

from types import SimpleNamespace

from voicertc.engine.scheduler import AUDIO_STEPS, pick_next, sink_heads
from voicertc.engine.utterance import Utterance


def utt(name: str, *, opened_s: float, started: bool, queued_ms: float = 0.0, sink=None) -> Utterance:
    sink = sink or SimpleNamespace(queued_ms=queued_ms)
    return Utterance(
        utterance_id=name,
        voice="v",
        sink=sink,  # type: ignore[arg-type]
        on_event=lambda e: None,
        generation=0,
        opened_s=opened_s,
        first_audio_s=1.0 if started else None,
    )


def test_a_starving_playing_utterance_goes_before_new_first_chunks():
    starving = utt("starving", opened_s=0.0, started=True, queued_ms=120)
    new = utt("new", opened_s=5.0, started=False)
    assert pick_next([new, starving]).utterance_id == "starving"


def test_first_audio_goes_before_well_fed_playback_oldest_first():
    fed = utt("fed", opened_s=0.0, started=True, queued_ms=2500)
    older = utt("older", opened_s=1.0, started=False)
    newer = utt("newer", opened_s=2.0, started=False)
    assert pick_next([fed, newer, older]).utterance_id == "older"


def test_a_first_audio_that_takes_many_units_takes_turns_instead_of_going_first():
    slow = utt("slow", opened_s=0.0, started=False)  # e.g. a whole speed-changed segment
    slow.steps = AUDIO_STEPS
    new = utt("new", opened_s=5.0, started=False)
    new.steps = 3
    assert pick_next([slow, new]).utterance_id == "new"
    fed = utt("fed", opened_s=1.0, started=True, queued_ms=2500)
    fed.steps = 40
    assert pick_next([slow, fed]).utterance_id == "fed"  # least served first among the turn-takers
    slow.steps = AUDIO_STEPS - 1
    assert pick_next([slow, new, fed]).utterance_id == "slow"  # until then: oldest first audio first


def test_a_starving_utterance_long_without_audio_takes_turns_instead_of_going_first():
    window = utt("window", opened_s=0.0, started=True, queued_ms=0)  # between whole windows
    window.steps, window.steps_at_audio = 900, 900 - AUDIO_STEPS
    new = utt("new", opened_s=5.0, started=False)
    assert pick_next([window, new]).utterance_id == "new"
    window.steps_at_audio += 1  # it made audio recently: its deadline counts
    assert pick_next([window, new]).utterance_id == "window"
    window.longest_audio_gap_steps = AUDIO_STEPS  # ... unless its audio has come in bursts before
    assert pick_next([window, new]).utterance_id == "new"


def test_fed_utterances_take_turns_and_the_emptiest_starving_one_goes_first():
    a = utt("a", opened_s=0.0, started=True, queued_ms=3000)
    b = utt("b", opened_s=1.0, started=True, queued_ms=900)
    a.steps, b.steps = 4, 5
    assert pick_next([a, b]).utterance_id == "a"
    low = utt("low", opened_s=2.0, started=True, queued_ms=50)
    lower = utt("lower", opened_s=3.0, started=True, queued_ms=10)
    low.steps = lower.steps = 100
    assert pick_next([a, b, low, lower]).utterance_id == "lower"


def test_only_the_oldest_utterance_of_each_sink_is_a_candidate():
    shared = SimpleNamespace(queued_ms=0.0)
    first = utt("first", opened_s=0.0, started=False, sink=shared)
    second = utt("second", opened_s=1.0, started=False, sink=shared)
    other = utt("other", opened_s=2.0, started=False)
    assert [u.utterance_id for u in sink_heads([first, second, other])] == ["first", "other"]
