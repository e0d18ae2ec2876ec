"""Playout numbers that tell the truth whatever stalls the track (issue 24, item 5): frames skipped by a
re-anchor while an utterance plays are underrun frames, frames sent over a frame late are late frames,
and pauses over 100 ms between frames are gaps. An injected clock stands in for a stalled event loop."""

from __future__ import annotations

import numpy as np
import pytest
from test_track import FakeTime, make_track

from voicertc.webrtc.track import PlayoutEvent


@pytest.fixture
def playing():
    """A track playing 2 s of one utterance, on a fake clock."""
    events: list[PlayoutEvent] = []
    fake = FakeTime()
    track, ring, _ = make_track(fake=fake, events=events)
    ring.write(np.full(48000 * 2, 1000, np.int16), "u", 0)
    return track, ring, fake, events


async def test_a_loop_stall_past_the_re_anchor_counts_the_skipped_frames_as_underruns(playing):
    track, ring, fake, events = playing
    for _ in range(5):
        await track.recv()
    assert (track.stats.underrun_frames, track.stats.late_frames, track.stats.gaps_over_100ms) == (0, 0, 0)
    fake.now += 0.5  # the event loop held for 500 ms: 25 frames were due and none went out
    await track.recv()
    assert track.stats.reanchors == 1
    assert track.stats.underrun_frames == 24  # 500 ms late = 24 frames skipped + this one sent late
    assert track.stats.late_frames == 1 and track.stats.gaps_over_100ms == 1
    for _ in range(5):  # on schedule again: nothing more counted
        await track.recv()
    assert (track.stats.underrun_frames, track.stats.late_frames, track.stats.gaps_over_100ms) == (24, 1, 1)
    ring.end_utterance("u", 0)
    ring.clear()
    track.interrupt()
    assert events[-1].kind == "interrupted" and events[-1].underrun_frames == 24


async def test_a_stall_under_the_re_anchor_is_late_frames_and_one_gap_not_silence(playing):
    track, _, fake, _ = playing
    await track.recv()
    fake.now += 0.15  # 150 ms behind: below max_lag_ms, so the track catches up in a burst
    for _ in range(8):
        await track.recv()
    assert track.stats.reanchors == 0 and track.stats.underrun_frames == 0
    assert track.stats.late_frames == 6  # 130, 110, ... 30 ms late (more than one 20 ms frame); 10 ms is not
    assert track.stats.gaps_over_100ms == 1


async def test_a_slow_loop_that_wakes_late_every_frame_shows_as_late_frames():
    fake = FakeTime(lateness_s=lambda: 0.025)  # every sleep ends 25 ms late (a CPU-starved loop)
    track, ring, _ = make_track(fake=fake)
    ring.write(np.full(48000, 1000, np.int16), "u", 0)
    for _ in range(20):
        await track.recv()
    # every other frame wakes 25 ms past its due time; the next is then due already and goes at once
    assert track.stats.late_frames == 10
    assert track.stats.underrun_frames == 0 and track.stats.gaps_over_100ms == 0


async def test_idle_silence_on_time_counts_nothing():
    track, _, _ = make_track()
    for _ in range(50):
        await track.recv()
    assert (track.stats.underrun_frames, track.stats.late_frames, track.stats.gaps_over_100ms) == (0, 0, 0)
