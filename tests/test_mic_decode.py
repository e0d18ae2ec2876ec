"""`webrtc.mic_decode`: a routed remote track's decoded frames reach their sink on aiortc's decoder
thread, not through the event loop; the track still ends; an unrouted track is aiortc's as before.

Two real aiortc peers on loopback, real Opus: the sender plays a 440 Hz tone.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection
from aiortc.mediastreams import MediaStreamError
from listen_helpers import clip_track

from voicertc.webrtc import mic_decode
from voicertc.webrtc.loopback import patch_aioice_loopback


@pytest.fixture(autouse=True)
def loopback():
    restore = patch_aioice_loopback()
    mic_decode.install()
    yield
    restore()


def tone_16k(seconds: float) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000.0
    return (0.3 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)


async def connect(route: bool):
    """A sender with the tone and a receiver; `route`: the receiver's track goes to a sink."""
    sender = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    receiver = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    sender.addTrack(clip_track(tone_16k(1.0), loop_clip=True))
    got: list[tuple[str, np.ndarray]] = []
    arrived = threading.Event()
    tracks: list = []

    def sink(frame) -> None:
        got.append((threading.current_thread().name, frame.to_ndarray()))
        if len(got) >= 25:
            arrived.set()

    @receiver.on("track")
    def on_track(track) -> None:
        tracks.append(track)
        if route:
            assert mic_decode.route_decoded(track, sink)

    await sender.setLocalDescription(await sender.createOffer())
    await receiver.setRemoteDescription(sender.localDescription)
    await receiver.setLocalDescription(await receiver.createAnswer())
    await sender.setRemoteDescription(receiver.localDescription)
    return sender, receiver, tracks, got, arrived


async def test_routed_frames_reach_the_sink_on_the_decoder_thread_and_the_track_still_ends():
    sender, receiver, tracks, got, arrived = await connect(route=True)
    try:
        assert await asyncio.get_running_loop().run_in_executor(None, arrived.wait, 10.0)
        track = tracks[0]
        assert track._queue.qsize() == 0  # nothing went through the loop
        names = {name for name, _ in got}
        assert names == {"audio-decoder"}, names
        pcm = np.concatenate([samples.reshape(-1) for _, samples in got[5:]]).astype(np.float32)
        spectrum = np.abs(np.fft.rfft(pcm[::2]))  # left channel of the interleaved 48 kHz stereo
        assert abs(np.argmax(spectrum) * 48000 / pcm[::2].size - 440.0) < 10.0
    finally:
        await sender.close()
        await receiver.close()
    with pytest.raises(MediaStreamError):  # the end still reaches the track
        await asyncio.wait_for(tracks[0].recv(), 5.0)


async def test_an_unrouted_track_yields_its_frames_through_recv():
    sender, receiver, tracks, got, _ = await connect(route=False)
    try:
        for _ in range(200):
            if tracks:
                break
            await asyncio.sleep(0.01)
        frames = [await asyncio.wait_for(tracks[0].recv(), 10.0) for _ in range(10)]
        assert all(frame.samples == 960 and frame.sample_rate == 48000 for frame in frames)
        assert got == []
    finally:
        await sender.close()
        await receiver.close()


def test_a_non_aiortc_track_is_not_routed():
    class Other:
        pass

    assert mic_decode.route_decoded(Other(), lambda frame: None) is False
