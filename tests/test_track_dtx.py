"""SpeechTrack with DTX (`send_silence_as(..., dtx=True)`), on an injected clock: a silence is sent for
200 ms, then one 1-byte DTX packet per 400 ms with the track asleep in between; samples written to the
ring wake it and go out on the schedule's grid with the pts of their time; nothing counts as a gap or
an underrun; stop() ends a recv() asleep in DTX."""

from __future__ import annotations

import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError
from av import AudioFrame, Packet
from test_track import FakeTime, sine_int16

from voicertc.audio import PcmRing
from voicertc.webrtc import SpeechTrack
from voicertc.webrtc.dtx import HANGOVER_FRAMES, REFRESH_FRAMES
from voicertc.webrtc.opus_send import silence_payload

FRAME_S = 0.02


class DtxTime(FakeTime):
    """FakeTime whose DTX waits end at a scheduled ring write (made then) or at their timeout."""

    def __init__(self, ring: PcmRing) -> None:
        super().__init__()
        self.ring = ring
        self.writes: list[tuple[float, np.ndarray]] = []
        self.waits: list[float] = []
        self.on_wait = lambda: None

    async def wait_data(self, event, timeout_s: float) -> None:
        self.waits.append(timeout_s)
        self.on_wait()
        if self.writes and self.writes[0][0] <= self.now + timeout_s:
            at, pcm = self.writes.pop(0)
            self.now = max(self.now, at)
            self.ring.write(pcm, "u", self.ring.generation)
            self.ring.end_utterance("u", self.ring.generation)
            return
        self.now += timeout_s


def dtx_track(dtx: bool = True):
    ring = PcmRing(high_water_ms=2000.0)
    fake = DtxTime(ring)
    track = SpeechTrack(ring, clock=fake.clock, sleep=fake.sleep, wait_data=fake.wait_data)
    track.send_silence_as(silence_payload(), dtx=dtx)
    return track, ring, fake


async def test_a_silence_goes_out_as_one_dtx_packet_per_400_ms_with_the_track_asleep_between():
    track, _, fake = dtx_track()
    t0 = fake.now
    first = [await track.recv() for _ in range(HANGOVER_FRAMES)]
    assert [f.pts for f in first] == [960 * i for i in range(HANGOVER_FRAMES)]
    sent_at = []
    for _ in range(3):
        packet = await track.recv()
        sent_at.append(fake.now - t0)
        assert isinstance(packet, Packet) and bytes(packet) == bytes([silence_payload()[0] & 0xFC])
        assert packet.pts == round(sent_at[-1] / FRAME_S) * 960
    assert np.allclose(np.diff([0.0, *sent_at]), [HANGOVER_FRAMES * FRAME_S] + [REFRESH_FRAMES * FRAME_S] * 2)
    assert fake.waits == pytest.approx([(REFRESH_FRAMES - 1) * FRAME_S] * 2)  # one wait per DTX period
    stats = track.stats
    assert stats.frames_sent == HANGOVER_FRAMES + 3 and stats.dtx_frames == 2 * (REFRESH_FRAMES - 1)
    assert stats.gaps_over_100ms == stats.late_frames == stats.underrun_frames == 0


async def test_samples_written_during_dtx_wake_the_track_and_keep_their_time():
    track, _, fake = dtx_track()
    t0 = fake.now
    for _ in range(HANGOVER_FRAMES + 1):  # the hangover, then the DTX packet
        await track.recv()
    speech = sine_int16(0.2)
    fake.writes.append((t0 + 0.305, speech))
    frame = await track.recv()
    assert isinstance(frame, AudioFrame)
    assert fake.now == pytest.approx(t0 + 0.305)  # sent as soon as it was written (its frame was due)
    assert frame.pts == 15 * 960  # frame 15 of the schedule: due at 300 ms
    rest = [await track.recv() for _ in range(10)]
    assert [f.pts for f in rest] == [960 * (16 + i) for i in range(10)]
    sent = np.concatenate([f.to_ndarray()[0][::2] for f in [frame, *rest]])
    np.testing.assert_array_equal(sent[: speech.size], speech)
    stats = track.stats
    assert stats.gaps_over_100ms == stats.late_frames == stats.underrun_frames == stats.reanchors == 0


async def test_an_utterance_that_stalls_into_dtx_counts_every_frame_it_missed_as_an_underrun():
    track, ring, fake = dtx_track()
    ring.write(sine_int16(0.1), "u", ring.generation)  # 5 frames, then the engine stalls (no end mark)
    frames = [await track.recv() for _ in range(5 + HANGOVER_FRAMES + 2)]  # the stall reaches DTX
    assert isinstance(frames[-2], Packet)  # the DTX packet, mid-utterance
    due = round((fake.now - 1000.0) / FRAME_S) + 1  # frames due so far, the last one included
    assert track.stats.underrun_frames == due - 5, track.stats  # every frame after the 5 with audio
    assert track.stats.dtx_frames > 0 and track.playing_utterance == "u"


async def test_without_dtx_every_silent_frame_goes_out():
    track, _, fake = dtx_track(dtx=False)
    frames = [await track.recv() for _ in range(3 * REFRESH_FRAMES)]
    assert [f.pts for f in frames] == [960 * i for i in range(3 * REFRESH_FRAMES)]
    assert fake.waits == [] and track.stats.dtx_frames == 0


async def test_stop_ends_a_recv_asleep_in_dtx():
    track, _, fake = dtx_track()
    for _ in range(HANGOVER_FRAMES + 1):
        await track.recv()
    fake.on_wait = track.stop
    with pytest.raises(MediaStreamError):
        await track.recv()
