"""Quiet windows while nothing is going on are not scored by Silero (`SileroVad.skip`): the events stay
those of scoring every window, and the scores after a skipped stretch stay close to it.

The oracle scores every 32 ms window and applies the listener's level rule (a window below
`min_level_dbfs` is capped between the two thresholds), as the listener did before it skipped.
"""

from __future__ import annotations

import numpy as np
import pytest
from listen_helpers import caller_clip

from voicertc.config import ListenConfig
from voicertc.listen.listener import ListenThread, _dbfs
from voicertc.listen.models import REPLAY_WINDOWS, VAD_WINDOW, SileroVad
from voicertc.listen.vad import SpeechStarted, SpeechStopped, VadEvent, VadStateMachine

WINDOW_MS = 1000.0 * VAD_WINDOW / 16000


@pytest.fixture(scope="module")
def clip() -> np.ndarray:
    pcm, _ = caller_clip(
        [1.0, "What time does the library open tomorrow?", 0.8, "And on Sunday?", 1.2, "Thanks.", 0.6]
    )
    return pcm


def with_noise(pcm: np.ndarray, noise_dbfs: float | None) -> np.ndarray:
    """16 kHz int16 of the clip with white noise at `noise_dbfs` RMS (None: digital silence between words)."""
    if noise_dbfs is not None:
        rng = np.random.default_rng(7)
        pcm = pcm + rng.normal(0.0, 10 ** (noise_dbfs / 20), pcm.size).astype(np.float32)
    return np.round(np.clip(pcm, -1, 1) * 32767).astype(np.int16)


def windows(pcm16: np.ndarray) -> list[np.ndarray]:
    return [
        pcm16[i : i + VAD_WINDOW].astype(np.float32) / 32768.0
        for i in range(0, pcm16.size - VAD_WINDOW + 1, VAD_WINDOW)
    ]


def oracle_events(pcm16: np.ndarray, config: ListenConfig) -> list[VadEvent]:
    vad = SileroVad()
    machine = VadStateMachine(config.threshold, config.min_speech_ms, config.min_silence_ms)
    events = []
    for i, window in enumerate(windows(pcm16)):
        prob = vad(window)
        if _dbfs(window) < config.min_level_dbfs:
            prob = min(prob, (machine.threshold + machine.low_threshold) / 2)
        event = machine.update(prob, i * WINDOW_MS, (i + 1) * WINDOW_MS)
        if event is not None:
            events.append(event)
    return events


def listener_events(pcm16: np.ndarray, config: ListenConfig) -> tuple[list[VadEvent], int]:
    events: list[VadEvent] = []

    def post(kind: str, *args: object) -> None:
        if kind in ("started", "stopped"):
            events.append(args[1])  # type: ignore[arg-type]

    thread = ListenThread("skip-test", config, post, None)
    for start in range(0, pcm16.size - 319, 320):  # 20 ms frames, as decoded from the caller
        thread.process(pcm16[start : start + 320], 16000, 1, start, 320)
    return events, thread._vad.windows_skipped


@pytest.mark.parametrize("noise_dbfs", [None, -70.0, -60.0])
def test_events_are_those_of_scoring_every_window(clip, noise_dbfs):
    config = ListenConfig()
    pcm16 = with_noise(clip, noise_dbfs)
    expected = oracle_events(pcm16, config)
    got, skipped = listener_events(pcm16, config)
    quiet = sum(_dbfs(w) < config.min_level_dbfs for w in windows(pcm16))
    assert skipped >= quiet // 2, f"only {skipped} of {quiet} quiet windows were skipped"
    # Piper renders the clip a little differently in each process (its noise is not seeded), so a phrase
    # may come out as two segments: the oracle says how many; the listener must find the same ones
    assert [type(e) for e in got] == [type(e) for e in expected]
    assert len(expected) >= 6 and [type(e) for e in expected] == [SpeechStarted, SpeechStopped] * (
        len(expected) // 2
    )
    for g, e in zip(got, expected, strict=True):
        for field in ("at_ms", "confirmed_ms") + (("end_ms",) if isinstance(e, SpeechStopped) else ()):
            # Silero's recurrent state remembers a quiet stretch longer than the replay: one window at most
            assert abs(getattr(g, field) - getattr(e, field)) <= WINDOW_MS, (field, g, e)


def test_scores_after_a_skipped_stretch_stay_close(clip):
    config = ListenConfig()
    quiet_windows = windows(with_noise(clip, -65.0))
    reference = SileroVad()
    full = [reference(w) for w in quiet_windows]
    skipping = SileroVad()
    diffs = []
    for window, prob in zip(quiet_windows, full, strict=True):
        if _dbfs(window) < config.min_level_dbfs and prob < 0.35:
            skipping.skip(window)
        else:
            diffs.append(abs(skipping(window) - prob))
    assert skipping.windows_skipped > 2 * REPLAY_WINDOWS
    assert max(diffs) < 0.1, f"scores after a skip moved by {max(diffs):.3f}"


def test_a_loud_or_busy_window_is_always_scored(clip):
    """Speech, and quiet windows while speech is pending or going on, run the model."""
    config = ListenConfig()
    pcm16 = with_noise(clip, None)
    scored: list[int] = []
    thread = ListenThread("skip-test", config, lambda *a: None, None)
    vad = thread._vad
    original = vad._score

    def counting(window: np.ndarray) -> float:
        scored.append(1)
        return original(window)

    vad._score = counting  # type: ignore[method-assign]
    for start in range(0, pcm16.size - 319, 320):
        thread.process(pcm16[start : start + 320], 16000, 1, start, 320)
    all_windows = windows(pcm16)
    loud = sum(_dbfs(w) >= config.min_level_dbfs for w in all_windows)
    assert len(scored) >= loud
    assert len(scored) + vad.windows_skipped >= len(all_windows) - 1
    assert len(scored) < len(all_windows)  # and the silence before the first word was not scored


def test_idle_means_nothing_can_change_on_an_unvoiced_window():
    machine = VadStateMachine(0.5, 200, 300)
    assert machine.idle
    machine.update(0.9, 0, 32)
    assert not machine.idle  # an onset is pending
    for i in range(1, 10):
        machine.update(0.9, 32 * i, 32 * (i + 1))
    assert machine.speaking and not machine.idle
    machine.update(0.4, 320, 352)  # between the thresholds: the latch holds
    assert not machine.idle
    t = 352
    while machine.speaking:
        machine.update(0.0, t, t + 32)
        t += 32
    assert machine.idle
