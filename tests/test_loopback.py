"""Two in-process aiortc peers on 127.0.0.1: the SpeechTrack's audio arrives, and an interrupt silences
it within 100 ms of media time (measured on the received frames' pts)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from voicertc.audio import PcmRing, RingSink
from voicertc.config import FakeConfig
from voicertc.engine.fake import FakeEngine
from voicertc.webrtc import PlayoutEvent, SpeechTrack, loopback_only_sdp, patch_aioice_loopback

RTP_WRAP = 2**32
SILENT_RMS = 1e-3


@pytest.fixture
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


class Receiver:
    """Collects the client's decoded frames as (media position in samples, mono float PCM)."""

    def __init__(self, track) -> None:
        self.frames: list[tuple[int, np.ndarray]] = []
        self.sample_rates: set[int] = set()
        self._first_pts: int | None = None
        self.task = asyncio.ensure_future(self._run(track))

    async def _run(self, track) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:  # the peer connection closed
                return
            if self._first_pts is None:
                self._first_pts = frame.pts
            self.sample_rates.add(frame.sample_rate)
            pcm = frame.to_ndarray()[0].astype(np.float32) / 32768.0
            channels = len(frame.layout.channels)
            self.frames.append(((frame.pts - self._first_pts) % RTP_WRAP, pcm[::channels]))

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    def loud(self) -> list[tuple[int, np.ndarray]]:
        return [(pos, pcm) for pos, pcm in self.frames if rms(pcm) > SILENT_RMS]

    async def wait_for(self, condition, timeout_s: float = 10.0) -> None:
        await poll(lambda: condition() or self.task.done(), timeout_s)
        assert not self.task.done(), f"receiver stopped: {self.task}"


async def poll(condition, timeout_s: float = 10.0) -> None:
    """Wait until `condition()` holds (checked every 20 ms), failing after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


def rms(pcm: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(pcm, dtype=np.float64))))


async def connect(server_track: SpeechTrack):
    client = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    server = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    client.addTransceiver("audio", direction="recvonly")
    remote_track = asyncio.get_running_loop().create_future()
    client.on("track", remote_track.set_result)
    await client.setLocalDescription(await client.createOffer())
    offer = client.localDescription
    await server.setRemoteDescription(RTCSessionDescription(loopback_only_sdp(offer.sdp), offer.type))
    server.addTrack(server_track)
    await server.setLocalDescription(await server.createAnswer())
    answer = server.localDescription
    await client.setRemoteDescription(RTCSessionDescription(loopback_only_sdp(answer.sdp), answer.type))
    return client, server, await asyncio.wait_for(remote_track, 10)


def write_sine_from_thread(sink: RingSink, stop: threading.Event, seconds: float = 5.0) -> threading.Thread:
    """A stand-in engine: 24 kHz sine pieces of 100 ms while the sink has room, until dropped."""

    def run() -> None:
        generation = sink.generation
        rate_hz, piece = 24000, 2400
        t = np.arange(int(rate_hz * seconds)) / rate_hz
        pcm = (0.5 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)
        for start in range(0, len(pcm), piece):
            while not sink.has_room() and not stop.is_set():
                time.sleep(0.005)
            if stop.is_set() or not sink.write(pcm[start : start + piece], rate_hz, "sine", generation):
                return
        sink.end_utterance("sine", generation)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


async def test_loopback_only_sdp_drops_foreign_candidates():
    sdp = (
        "v=0\r\n"
        "a=candidate:1 1 udp 2130706431 192.0.2.2 50000 typ host\r\n"
        "a=candidate:2 1 udp 2130706431 127.0.0.1 50001 typ host\r\n"
        "a=candidate:3 1 udp 2130706431 abcd.local 50002 typ host\r\n"
        "a=end-of-candidates\r\n"
    )
    assert loopback_only_sdp(sdp) == (
        "v=0\r\na=candidate:2 1 udp 2130706431 127.0.0.1 50001 typ host\r\na=end-of-candidates\r\n"
    )


async def test_sine_arrives_and_interrupt_silences_within_100ms(loopback_ice):
    ring = PcmRing(high_water_ms=1000.0)
    sink = RingSink(ring)
    track = SpeechTrack(ring)
    stop = threading.Event()
    writer = write_sine_from_thread(sink, stop)
    client = server = receiver = None
    try:
        await poll(lambda: ring.queued_ms >= 500)
        client, server, remote = await connect(track)
        receiver = Receiver(remote)
        await receiver.wait_for(lambda: len(receiver.loud()) >= 25)
        assert receiver.sample_rates == {48000}
        onset = receiver.loud()[0][0]  # server pts 0 (the ring was full from the start)
        assert rms(np.concatenate([pcm for _, pcm in receiver.loud()[5:25]])) > 0.3  # 0.5 amplitude sine
        interrupted_at = track.samples_sent
        result = track.interrupt()
        assert result.utterance_id == "sine" and result.played_ms > 400
        await receiver.wait_for(lambda: receiver.frames[-1][0] > onset + interrupted_at + 48000 * 0.5)
        cut = onset + interrupted_at
        after = [rms(pcm) for pos, pcm in receiver.frames if pos >= cut + 4800]  # > 100 ms after the cut
        before = [rms(pcm) for pos, pcm in receiver.frames if onset + 960 <= pos < cut - 960]
        assert len(after) >= 15 and max(after) < SILENT_RMS
        assert min(before) > 0.2
        assert writer.is_alive() is False or ring.queued_samples == 0
    finally:
        stop.set()
        writer.join(2)
        if receiver is not None:
            await receiver.close()
        for pc in (client, server):
            if pc is not None:
                await pc.close()


async def test_fake_engine_speaks_through_the_track(loopback_ice):
    ring = PcmRing(high_water_ms=1000.0)
    sink = RingSink(ring)
    playout: list[PlayoutEvent] = []
    track = SpeechTrack(ring, on_playout=playout.append)
    engine_events = []
    engine = FakeEngine(FakeConfig())
    engine.start()
    client = server = receiver = None
    try:
        client, server, remote = await connect(track)
        receiver = Receiver(remote)
        await receiver.wait_for(lambda: len(receiver.frames) >= 5)
        utterance_id = engine.say(None, sink, engine_events.append, "hello world")
        await receiver.wait_for(lambda: any(e.kind == "done" for e in playout))
        loud = receiver.loud()
        assert len(loud) >= 10
        assert receiver.sample_rates == {48000}
        assert rms(np.concatenate([pcm for _, pcm in loud[2:-2]])) > 0.15  # 0.3 amplitude tone
        done = [e for e in playout if e.kind == "done"]
        assert [e.utterance_id for e in done] == [utterance_id]
        engine_done = [e for e in engine_events if type(e).__name__ == "Done"]
        assert len(engine_done) == 1
        assert done[0].played_ms == pytest.approx(engine_done[0].audio_ms, abs=2.0)
        assert done[0].underrun_frames == 0 or track.stats.underrun_frames >= done[0].underrun_frames
    finally:
        engine.stop()
        if receiver is not None:
            await receiver.close()
        for pc in (client, server):
            if pc is not None:
                await pc.close()


async def test_piper_speaks_through_the_track_and_an_interrupt_silences_it(loopback_ice):
    from voicertc.backends.piper import PiperBackend
    from voicertc.engine.worker import EngineWorker

    ring = PcmRing(high_water_ms=2000.0)
    sink = RingSink(ring)
    track = SpeechTrack(ring)
    engine = EngineWorker(PiperBackend(threads=1))
    engine.start()
    events: list = []
    client = server = receiver = None
    try:
        client, server, remote = await connect(track)
        receiver = Receiver(remote)
        await receiver.wait_for(lambda: len(receiver.frames) >= 5)
        text = "This is the bundled voice speaking a long sentence, so that there is time to interrupt it."
        engine.say(None, sink, events.append, text)
        await receiver.wait_for(lambda: len(receiver.loud()) >= 25)  # half a second of speech heard
        assert receiver.sample_rates == {48000}
        speech = np.concatenate([pcm for _, pcm in receiver.loud()])
        assert rms(speech) > 0.01
        cut_position = track.samples_sent
        result = track.interrupt()
        assert result.played_ms > 400
        await receiver.wait_for(lambda: receiver.frames[-1][0] > cut_position + 48000)
        late = [pcm for pos, pcm in receiver.frames if pos >= cut_position + 4800]  # 100 ms after the cut
        assert late and max(rms(pcm) for pcm in late) < SILENT_RMS
    finally:
        engine.stop()
        if receiver is not None:
            await receiver.close()
        for pc in (client, server):
            if pc is not None:
                await pc.close()
