"""SpeechTrack with an injected clock: frame format, contiguous pts, pacing without drift, underruns,
interrupt fades, playout events. No wall-clock sleeps."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError

from voicertc.audio import PcmRing, RingSink
from voicertc.config import WebRTCConfig
from voicertc.webrtc import PlayoutEvent, SpeechTrack


class FakeTime:
    """A monotonic clock that only moves when the track sleeps (plus optional lateness per sleep)."""

    def __init__(self, lateness_s=lambda: 0.0) -> None:
        self.now = 1000.0
        self.lateness_s = lateness_s

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.now += seconds + self.lateness_s()


def make_track(ring=None, fake=None, events=None, **kwargs):
    ring = ring or PcmRing(high_water_ms=2000.0)
    fake = fake or FakeTime()
    track = SpeechTrack(
        ring,
        clock=fake.clock,
        sleep=fake.sleep,
        on_playout=None if events is None else events.append,
        **kwargs,
    )
    return track, ring, fake


def mono(frame) -> np.ndarray:
    data = frame.to_ndarray()[0]
    return data[::2] if frame.layout.name == "stereo" else data


def sine_int16(seconds: float, freq_hz: float = 440.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(48000 * seconds)) / 48000
    return np.round(amp * 32767 * np.sin(2 * np.pi * freq_hz * t)).astype(np.int16)


@pytest.mark.parametrize("stereo", [True, False])
async def test_frame_format_and_contiguous_pts(stereo):
    track, ring, _ = make_track(stereo=stereo)
    ring.write(sine_int16(0.1), "u", 0)
    frames = [await track.recv() for _ in range(8)]
    for i, frame in enumerate(frames):
        assert frame.samples == 960
        assert frame.format.name == "s16"
        assert frame.layout.name == ("stereo" if stereo else "mono")
        assert frame.sample_rate == 48000
        assert frame.time_base == Fraction(1, 48000)
        assert frame.pts == 960 * i
    sent = np.concatenate([mono(f) for f in frames])
    np.testing.assert_array_equal(sent[:4800], sine_int16(0.1))
    assert not sent[4800:].any()
    if stereo:
        both = frames[0].to_ndarray()[0]
        np.testing.assert_array_equal(both[::2], both[1::2])


async def test_no_drift_over_ten_minutes():
    rng = np.random.default_rng(0)
    fake = FakeTime(lateness_s=lambda: float(rng.uniform(0.0, 0.004)))
    track, _, _ = make_track(fake=fake)
    t0 = fake.now
    worst_lag = 0.0
    for n in range(30_000):  # 10 minutes of 20 ms frames
        frame = await track.recv()
        assert frame.pts == 960 * n
        lag = fake.now - (t0 + 0.020 * n)
        assert lag >= -1e-9
        worst_lag = max(worst_lag, lag)
    assert worst_lag <= 0.004 + 1e-9  # never later than one sleep's lateness: no accumulated drift
    assert track.stats.frames_sent == 30_000
    assert track.stats.reanchors == 0


async def test_short_stall_catches_up_long_stall_reanchors():
    track, _, fake = make_track()
    for _ in range(5):
        await track.recv()
    fake.now += 0.1  # the loop stalled 100 ms: frames go out back-to-back until on schedule
    t_stall = fake.now
    for _ in range(5):
        await track.recv()
    assert fake.now == pytest.approx(t_stall)
    await track.recv()
    assert fake.now > t_stall
    fake.now += 0.5  # 500 ms behind: restart the schedule instead of a 25-frame burst
    t_stall = fake.now
    first = await track.recv()
    await track.recv()
    assert track.stats.reanchors == 1
    assert fake.now == pytest.approx(t_stall + 0.020)
    assert first.pts == 960 * 11  # pts stay contiguous across the re-anchor


async def test_silence_on_underrun_counted_only_mid_utterance():
    events: list[PlayoutEvent] = []
    track, ring, _ = make_track(events=events)
    for _ in range(3):  # idle: silence, not an underrun
        assert not mono(await track.recv()).any()
    assert track.stats.underrun_frames == 0
    ring.write(np.full(960 + 480, 1000, np.int16), "u", 0)
    assert mono(await track.recv()).min() == 1000
    assert events == [PlayoutEvent("started", "u")]
    half = mono(await track.recv())
    assert (half[:480] == 1000).all() and not half[480:].any()
    assert not mono(await track.recv()).any()
    assert track.stats.underrun_frames == 2
    ring.end_utterance("u", 0)
    await track.recv()
    await track.recv()
    assert track.stats.underrun_frames == 2
    assert events[-1] == PlayoutEvent("done", "u", played_ms=30.0, underrun_frames=2)


async def test_done_event_with_played_ms_and_back_to_back_utterances():
    events: list[PlayoutEvent] = []
    track, ring, _ = make_track(events=events)
    sink = RingSink(ring)
    sink.write(np.full(12_000, 0.25, np.float32), 48000, "a", sink.generation)  # 250 ms
    sink.end_utterance("a", sink.generation)
    sink.write(np.full(4_800, 0.25, np.float32), 24000, "b", sink.generation)  # 200 ms at 24 kHz
    sink.end_utterance("b", sink.generation)
    for _ in range(30):
        await track.recv()
    kinds = [(e.kind, e.utterance_id) for e in events]
    assert kinds == [("started", "a"), ("done", "a"), ("started", "b"), ("done", "b")]
    assert events[1].played_ms == pytest.approx(250.0)
    assert events[3].played_ms == pytest.approx(200.0, abs=0.1)
    assert track.stats.underrun_frames == 0


async def test_interrupt_fades_without_jump_and_reports_played_ms():
    events: list[PlayoutEvent] = []
    track, ring, _ = make_track(events=events, interrupt_fade_ms=10)
    sink = RingSink(ring)
    gen = sink.generation
    amp = 0.5
    pcm = sine_int16(1.0, amp=amp)
    sink.write(pcm.astype(np.float32) / 32767, 48000, "u", gen)
    sent = [mono(await track.recv()) for _ in range(10)]
    result = track.interrupt()
    assert result.utterance_id == "u"
    assert result.played_ms == pytest.approx(210.0)  # 10 frames + the 10 ms faded tail
    assert ring.queued_samples == 0 and sink.generation == gen + 1
    assert not sink.write(np.ones(480, np.float32), 48000, "u", gen)  # a late piece is dropped
    sink.end_utterance("u", gen)
    sent += [mono(await track.recv()) for _ in range(5)]
    audio = np.concatenate(sent).astype(np.float64)
    np.testing.assert_array_equal(audio[:9600], pcm[:9600])
    assert not audio[9600 + 480 :].any()  # silence after the fade
    natural_step = 2 * np.pi * 440 / 48000 * amp * 32767
    fade_step = np.pi / (2 * 481) * amp * 32767
    assert np.abs(np.diff(audio)).max() <= natural_step + fade_step + 2
    assert np.abs(audio[9600:10080]).max() > 0  # the tail was played, faded, not dropped
    assert [e.kind for e in events] == ["started", "interrupted"]
    assert events[-1].played_ms == pytest.approx(210.0)
    assert track.stats.interrupts == 1 and track.stats.underrun_frames == 0


async def test_interrupt_when_idle_and_cut_at_next_utterance():
    events: list[PlayoutEvent] = []
    track, ring, _ = make_track(events=events)
    assert track.interrupt().utterance_id is None
    gen = ring.generation
    ring.write(np.full(960 + 100, 500, np.int16), "a", gen)
    ring.end_utterance("a", gen)
    ring.write(np.full(2000, 700, np.int16), "b", gen)
    await track.recv()
    result = track.interrupt()  # only 100 samples of "a" left: "b" must not start in the tail
    assert result.utterance_id == "a"
    assert result.played_ms == pytest.approx(1060 / 48)
    frame = mono(await track.recv())
    assert np.abs(frame).max() <= 500 and not frame[100:].any()
    assert [e.kind for e in events] == ["started", "done"]


@pytest.mark.expected_errors("boom")
async def test_recv_never_raises_except_after_stop():
    track, ring, _ = make_track()

    def broken_read(n):
        raise RuntimeError("boom")

    ring.read = broken_read
    frame = await track.recv()  # the error is logged, silence is sent
    assert frame.samples == 960 and not mono(frame).any()
    track.stop()
    with pytest.raises(MediaStreamError):
        await track.recv()


@pytest.mark.expected_errors("listener bug")
async def test_callback_errors_are_isolated():
    def bad_callback(event):
        raise ValueError("listener bug")

    track, ring, _ = make_track()
    track.on_playout = bad_callback
    ring.write(np.full(960, 3, np.int16), "u", 0)
    assert mono(await track.recv()).max() == 3


def test_from_config_and_bad_arguments():
    ring = PcmRing()
    track = SpeechTrack.from_config(ring, WebRTCConfig(frame_ms=10, stereo=False, interrupt_fade_ms=5))
    assert track.frame_samples == 480 and not track.stereo and track.fade_samples == 240
    assert track.kind == "audio"
    with pytest.raises(ValueError, match="frame_ms"):
        SpeechTrack(ring, frame_ms=40)


async def test_settled_silence_goes_out_as_the_encoders_packet_on_one_timeline():
    from av import AudioFrame, Packet

    from voicertc.webrtc.opus_send import silence_payload
    from voicertc.webrtc.track import SILENT_FRAMES_ENCODED

    payload = silence_payload()
    assert payload is not None
    track, ring, _ = make_track()
    track.send_silence_as(payload)
    ring.write(sine_int16(0.1), "u", 0)  # 5 frames of tone, then silence
    sent = [await track.recv() for _ in range(5 + SILENT_FRAMES_ENCODED + 4)]
    ring.write(sine_int16(0.04), "v", 0)
    sent += [await track.recv() for _ in range(3)]
    kinds = [type(item) for item in sent]
    silent_encoded = 5 + SILENT_FRAMES_ENCODED
    assert kinds == [AudioFrame] * silent_encoded + [Packet] * 4 + [AudioFrame] * 3
    assert [item.pts for item in sent] == [960 * i for i in range(len(sent))]
    assert all(bytes(item) == payload for item in sent[silent_encoded : silent_encoded + 4])
    assert mono(sent[-2]).any()  # speech after the silence is a frame again, from its first sample
    assert track.silence_packets == 4 and track.stats.frames_sent == len(sent)


async def test_silence_stays_frames_unless_the_sender_encodes_opus_stereo_20ms():
    from av import AudioFrame

    from voicertc.webrtc.opus_send import silence_payload

    for kwargs, payload in (
        ({}, None),
        ({"stereo": False}, silence_payload()),
        ({"frame_ms": 10}, silence_payload()),
    ):
        track, _, _ = make_track(**kwargs)
        track.send_silence_as(payload)
        sent = [await track.recv() for _ in range(20)]
        assert all(isinstance(item, AudioFrame) for item in sent)
        assert track.silence_packets == 0
