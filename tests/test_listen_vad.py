"""Voice activity: the hysteresis state machine (pure, media time) and the bundled Silero model."""

from __future__ import annotations

import numpy as np
import pytest
from listen_helpers import caller_clip

from voicertc.listen.vad import SpeechStarted, SpeechStopped, VadStateMachine

WIN_MS = 32.0


def run(probs: list[float], machine: VadStateMachine | None = None) -> list:
    machine = machine or VadStateMachine(0.5, min_speech_ms=200, min_silence_ms=300)
    events = []
    for i, p in enumerate(probs):
        event = machine.update(p, i * WIN_MS, (i + 1) * WIN_MS)
        if event is not None:
            events.append((i, event))
    return events


def test_onset_after_min_speech_reports_the_first_voiced_window():
    probs = [0.0] * 10 + [0.9] * 20 + [0.0] * 20
    events = run(probs)
    (i_start, started), (i_stop, stopped) = events
    assert isinstance(started, SpeechStarted) and isinstance(stopped, SpeechStopped)
    assert started.at_ms == 10 * WIN_MS
    assert i_start == 10 + 6  # 7 windows of 32 ms = 224 ms >= 200 ms voiced
    assert stopped.at_ms == 10 * WIN_MS and stopped.end_ms == 30 * WIN_MS
    assert stopped.duration_ms == 20 * WIN_MS
    assert stopped.confirmed_ms - stopped.end_ms >= 300


def test_a_short_blip_is_not_speech():
    assert run([0.0] * 5 + [0.95] * 4 + [0.0] * 30) == []


def test_a_noisy_mic_does_not_flood_events():
    rng = np.random.default_rng(0)
    # a mic with noise bursts: 15 % of windows look voiced, scattered (64 s)
    probs = list(np.where(rng.random(2000) < 0.15, 0.9, 0.1))
    assert run(probs) == []
    # a level flickering across the threshold every window: one segment, not one per flicker
    flicker = [0.7, 0.3] * 500 + [0.0] * 20
    assert [type(e) for _, e in run(flicker)] == [SpeechStarted, SpeechStopped]


def test_hysteresis_keeps_speech_through_dips_above_the_low_threshold():
    # speech that dips to 0.4 (below 0.5, above 0.35) stays one segment
    probs = [0.9] * 10 + [0.4] * 15 + [0.9] * 10 + [0.0] * 20
    events = run(probs)
    assert [type(e) for _, e in events] == [SpeechStarted, SpeechStopped]
    assert events[1][1].end_ms == 35 * WIN_MS


def test_short_pauses_inside_speech_do_not_split_it():
    probs = [0.9] * 10 + [0.1] * 5 + [0.9] * 10 + [0.0] * 20  # 160 ms pause < 300 ms
    events = run(probs)
    assert [type(e) for _, e in events] == [SpeechStarted, SpeechStopped]
    probs = [0.9] * 10 + [0.1] * 12 + [0.9] * 10 + [0.0] * 20  # 384 ms pause: two segments
    assert [type(e) for _, e in run(probs)] == [SpeechStarted, SpeechStopped] * 2


def test_events_alternate():
    rng = np.random.default_rng(1)
    probs = list(rng.choice([0.0, 1.0], size=3000, p=[0.5, 0.5]).repeat(rng.integers(1, 30)))
    kinds = [type(e) for _, e in run(probs)]
    assert all(a is not b for a, b in zip(kinds, kinds[1:], strict=False))


@pytest.fixture(scope="module")
def piper_speech():
    return caller_clip(["What time does the library open tomorrow?"])


def test_silero_tells_speech_from_silence(piper_speech):
    from voicertc.listen.models import VAD_WINDOW, SileroVad

    vad = SileroVad()
    speech, _edges = piper_speech
    silence = np.zeros(16000, np.float32)
    noise = np.random.default_rng(2).normal(0, 0.003, 16000).astype(np.float32)

    def probs(pcm: np.ndarray) -> np.ndarray:
        vad.reset()
        return np.array([vad(pcm[i : i + VAD_WINDOW]) for i in range(0, pcm.size - VAD_WINDOW, VAD_WINDOW)])

    assert probs(silence).max() < 0.2
    assert probs(noise).max() < 0.5
    assert np.mean(probs(speech) > 0.5) > 0.4
