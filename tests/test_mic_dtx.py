"""The caller's side of DTX (`webrtc.mic_decode`, `ListenThread.fill_silence`): the mic's jitter
buffer releases frames on arrival and waits only behind a missing packet; a listener that hears a
DTX silence filled on time has the same timeline, PCM and events as one that got every silent frame;
and over real aiortc + Opus, a sender in DTX costs a few packets a second while the listener's
timeline keeps up with the wall clock."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection
from av import AudioFrame
from hypothesis import given, settings
from hypothesis import strategies as st
from listen_helpers import caller_clip

from voicertc.audio import PcmRing
from voicertc.config import ListenConfig
from voicertc.listen.listener import ListenThread
from voicertc.webrtc import SpeechTrack, mic_decode, opus_send
from voicertc.webrtc.loopback import patch_aioice_loopback
from voicertc.webrtc.mic_decode import JitterFrames, MicJitterBuffer

TS = 960


class Rtp:
    def __init__(self, seq: int, data: bytes = b"\xfc\x01\x02") -> None:
        self.sequence_number = seq % 65536
        self.timestamp = (seq * TS) % (1 << 32)
        self._data = data


def released(buffer: MicJitterBuffer, packet: Rtp) -> list[int]:
    """Timestamps the buffer releases for `packet`, in order."""
    _, frame = buffer.add(packet)
    if frame is None:
        return []
    frames = frame.frames() if isinstance(frame, JitterFrames) else [frame]
    return [f.timestamp for f in frames]


def test_frames_in_order_leave_as_they_arrive():
    buffer = MicJitterBuffer(max_wait_frames=4)
    assert [released(buffer, Rtp(s)) for s in range(5)] == [[s * TS] for s in range(5)]


def test_a_missing_packet_holds_later_ones_until_it_comes_or_the_wait_is_over():
    buffer = MicJitterBuffer(max_wait_frames=2)
    assert released(buffer, Rtp(0)) == [0]
    assert released(buffer, Rtp(2)) == [] and released(buffer, Rtp(3)) == []
    assert released(buffer, Rtp(1)) == [TS, 2 * TS, 3 * TS]  # it came: all three at once, in order
    assert released(buffer, Rtp(5)) == [] and released(buffer, Rtp(6)) == []
    assert released(buffer, Rtp(7)) == [5 * TS, 6 * TS, 7 * TS]  # waited 2 frames: 4 given up
    assert released(buffer, Rtp(4)) == [] and buffer.dropped == 1 and buffer.skipped == 1


def test_nothing_waits_behind_a_dtx_packet():
    buffer = MicJitterBuffer(max_wait_frames=4)
    released(buffer, Rtp(0))
    assert released(buffer, Rtp(2, b"\xfc")) == [2 * TS]


def test_sequence_numbers_wrap():
    buffer = MicJitterBuffer()
    seqs = [65534, 65535, 65536, 65537]
    assert [released(buffer, Rtp(s)) for s in seqs] == [[(s * TS) % (1 << 32)] for s in seqs]


@settings(max_examples=200, deadline=None)
@given(st.permutations(list(range(40))), st.sets(st.integers(0, 39), max_size=8), st.integers(1, 8))
def test_released_frames_are_increasing_and_each_arrived_packet_is_released_or_counted(order, lost, wait):
    buffer = MicJitterBuffer(max_wait_frames=wait)
    # reordering bounded like a network's: shuffle within windows of 4
    arrivals = [s for window in range(0, 40, 4) for s in sorted(order[window : window + 4]) if s not in lost]
    out = [ts for s in arrivals for ts in released(buffer, Rtp(1000 + s))]
    assert out == sorted(out) and len(set(out)) == len(out)
    held = len(buffer._held)
    assert len(out) + buffer.dropped + held == len(arrivals)


def listen_thread() -> tuple[ListenThread, list[np.ndarray]]:
    pcm: list[np.ndarray] = []

    def post(kind, *args) -> None:
        if kind == "pcm":
            pcm.extend(args[0])

    thread = ListenThread("c", ListenConfig(transcribe=False), post, None)
    thread.live_readers = 1
    return thread, pcm


def stereo_frame(mono: np.ndarray, pts: int) -> AudioFrame:
    frame = AudioFrame.from_ndarray(np.repeat(mono, 2)[None, :], format="s16", layout="stereo")
    frame.sample_rate, frame.pts = 48000, pts
    return frame


def test_a_dtx_silence_filled_on_time_is_heard_like_every_silent_frame():
    clip, _ = caller_clip(["Hello there.", 1.0, "Again."])
    pcm48 = np.round(np.repeat(clip, 3) * 32767).astype(np.int16)
    pcm48 = pcm48[: pcm48.size - pcm48.size % TS]
    frames = [pcm48[i : i + TS] for i in range(0, pcm48.size, TS)]
    silent = [i for i, f in enumerate(frames) if not f.any()]
    dtx = set(silent[10:-2])  # the caller's encoder stopped sending 200 ms into the silence
    whole, whole_pcm = listen_thread()
    for i, f in enumerate(frames):
        whole.process_frame(stereo_frame(f, i * TS))
    sparse, sparse_pcm = listen_thread()
    for i, f in enumerate(frames):
        if i in dtx:
            if i % 7 == 0:  # the decoder thread's fills, at irregular points, sometimes past a frame
                sparse.fill_silence((i + 2) * TS, 48000)
            if i == max(dtx):  # the last fill runs into the next two frames, which arrive late
                sparse.fill_silence((i + 2) * TS + 100, 48000)
            continue
        sparse.process_frame(stereo_frame(f, i * TS))  # a frame already filled is trimmed to its new part
    assert sparse._pos == whole._pos and sparse._next_pts == whole._next_pts
    np.testing.assert_array_equal(np.concatenate(sparse_pcm), np.concatenate(whole_pcm))
    assert sparse._machine.idle == whole._machine.idle


async def test_a_sender_in_dtx_costs_few_packets_and_the_listener_keeps_up_with_the_clock():
    restore = patch_aioice_loopback()
    opus_send.install()
    mic_decode.install()
    track = SpeechTrack(PcmRing())
    sender = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    receiver = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    sender.addTrack(track)
    thread, _ = listen_thread()
    thread.live_readers = 0

    @receiver.on("track")
    def on_track(remote) -> None:
        assert mic_decode.route_decoded(remote, thread.process_frame, thread)

    try:
        await sender.setLocalDescription(await sender.createOffer())
        await receiver.setRemoteDescription(sender.localDescription)
        await receiver.setLocalDescription(await receiver.createAnswer())
        await sender.setRemoteDescription(receiver.localDescription)
        track.send_silence_as(opus_send.silence_payload(), dtx=True)
        for _ in range(500):
            if thread.frames_received:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # past the hangover: the sender is in DTX
        frames0, pos0, t0 = thread.frames_received, thread._pos, time.monotonic()
        await asyncio.sleep(2.0)
        frames, heard_s = thread.frames_received - frames0, (thread._pos - pos0) / 16000
        elapsed = time.monotonic() - t0
    finally:
        await sender.close()
        await receiver.close()
        restore()
    assert frames <= 4 * elapsed, frames  # 2.5 DTX packets a second, not 50 frames
    assert heard_s == pytest.approx(elapsed, abs=0.2), (heard_s, elapsed)
    assert track.stats.dtx_frames > 60
