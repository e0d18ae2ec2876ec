"""Two-way calls between two in-process aiortc peers: the caller's mic (a Piper clip) reaches the call's
listener; VAD events land on the clip's speech edges, transcripts are right, barge-in cuts the agent
and reports what was heard; a silent mic never barges in; video and unknown codecs are handled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from call_helpers import fake_config, rms
from listen_helpers import caller_clip, clip_track, g722_only, wer

from voicertc.assemble import create_engine
from voicertc.listen.models import load_listen_models
from voicertc.webrtc import patch_aioice_loopback
from voicertc.webrtc.call import Call, UnsupportedCodecError

QUESTION = "What time does the library open tomorrow morning?"
LONG_REPLY = "This is the agent talking for quite a while about nothing in particular. " * 8
EDGE_MS = 150.0


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


class Caller:
    """The browser side: a mic track (clip or silence), receives audio and `events`."""

    def __init__(self, mic, video: bool = False) -> None:
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = mic
        self.events: list[dict] = []
        self.arrived = asyncio.Event()
        self.loud_frames: list[float] = []  # loop times of received frames louder than -40 dBFS
        self.channel = self.pc.createDataChannel("events")
        self.channel.on("message", self._on_message)
        self.pc.addTrack(mic)
        if video:
            self.pc.addTransceiver("video", direction="recvonly")
        self.pc.on("track", self._on_track)
        self._reader: asyncio.Task | None = None

    def _on_message(self, message: str) -> None:
        self.events.append(json.loads(message))
        self.arrived.set()

    def _on_track(self, track) -> None:
        if track.kind == "audio":
            self._reader = asyncio.ensure_future(self._read(track))

    async def _read(self, track) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):
            while True:
                frame = await track.recv()
                pcm = frame.to_ndarray().astype(np.float32) / 32768.0
                if rms(pcm) > 0.01:
                    self.loud_frames.append(loop.time())

    async def wait_event(self, kind: str, timeout_s: float = 20.0, after: int = 0) -> dict:
        async def find() -> dict:
            while True:
                for event in self.events[after:]:
                    if event["type"] == kind:
                        return event
                self.arrived.clear()
                await self.arrived.wait()

        return await asyncio.wait_for(find(), timeout_s)

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]


@contextlib.asynccontextmanager
async def two_way(mic, video: bool = False, **sections):
    config = fake_config(**sections)
    await asyncio.get_running_loop().run_in_executor(None, load_listen_models, config.listen)
    engine = create_engine(config)
    engine.start()
    call = Call("c1", engine, config)
    caller = Caller(mic, video=video)
    try:
        await caller.pc.setLocalDescription(await caller.pc.createOffer())
        answer = await call.answer(caller.pc.localDescription.sdp)
        await caller.pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        opened = asyncio.Event()
        caller.channel.on("open", opened.set)
        if caller.channel.readyState != "open":
            await asyncio.wait_for(opened.wait(), 10)
        yield call, caller
    finally:
        if caller._reader is not None:
            caller._reader.cancel()
        await caller.pc.close()
        await call.close("test over")
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)


async def test_speech_events_on_the_clip_edges_and_the_transcript():
    pcm, spoken = caller_clip([1.0, QUESTION, 1.5])
    async with two_way(clip_track(pcm), listen={"barge_in": "off"}) as (call, caller):
        started = await caller.wait_event("user.speech.started")
        stopped = await caller.wait_event("user.speech.stopped")
        transcript = await caller.wait_event("user.transcript")
        question = spoken[0]
        assert abs(started["at_ms"] - 1000 * question.start_s) <= EDGE_MS, (started, question)
        assert abs(stopped["at_ms"] - 1000 * question.end_s) <= EDGE_MS, (stopped, question)
        assert abs(stopped["duration_ms"] - 1000 * (question.end_s - question.start_s)) <= EDGE_MS
        assert wer(QUESTION, transcript["text"]) <= 0.2, transcript
        assert transcript["start_ms"] == started["at_ms"] and transcript["end_ms"] == stopped["at_ms"]
        # the agent's own API sees the same events and the PCM
        frames = []
        async for frame in call.listen():
            frames.append(frame)
            if len(frames) == 10:
                break
        assert all(f.dtype == np.int16 and f.size == 320 for f in frames)
        assert len(caller.of("user.speech.started")) == 1  # one question, one segment
        assert call.counters()["user_speech_segments"] == 1


async def test_speech_barge_in_cuts_the_playing_utterance_and_reports_what_was_heard():
    pcm, spoken = caller_clip([2.5, QUESTION, 1.0])
    async with two_way(clip_track(pcm), listen={"barge_in": "speech", "transcribe": False}) as (
        call,
        caller,
    ):
        loop = asyncio.get_running_loop()
        handle = call.speak(LONG_REPLY)
        cut = await asyncio.wait_for(handle.done(), 20)
        cut_s = loop.time()
        assert cut["type"] == "speech.interrupted"
        assert 1500 < cut["played_ms"] < 1000 * spoken[0].start_s + 1000
        heard = cut["heard_text"]
        assert heard and LONG_REPLY.startswith(heard), heard
        assert cut["barge_in"] == "speech"
        await asyncio.sleep(0.5)
        assert not [t for t in caller.loud_frames if t > cut_s + 0.25]  # quiet after the cut
        assert call.counters()["barge_ins"] == 1


async def test_words_mode_ignores_a_backchannel_and_cuts_on_the_question():
    pcm, spoken = caller_clip([1.5, "Yeah.", 2.0, QUESTION, 1.0])
    listen = {"barge_in": "words", "min_speech_ms": 120}
    async with two_way(clip_track(pcm), listen=listen) as (call, caller):
        handle = call.speak(LONG_REPLY)
        cut = await asyncio.wait_for(handle.done(), 30)
        assert cut["type"] == "speech.interrupted" and cut["barge_in"] == "words"
        assert LONG_REPLY.startswith(cut["heard_text"])
        policy = call.listener.policy
        # exactly one barge-in, decided on the question (segment 2) by a word that is no backchannel
        assert [(d.reason, d.segment) for d in policy.decisions] == [("words", 2)]
        assert abs(policy.decisions[0].onset_ms - 1000 * spoken[1].start_s) <= EDGE_MS
        assert call.counters()["barge_ins"] == 1
        transcripts = [await caller.wait_event("user.transcript", 30)]
        transcripts.append(
            await caller.wait_event("user.transcript", 30, after=caller.events.index(transcripts[0]) + 1)
        )
        assert re.sub(r"\W", "", transcripts[0]["text"].lower()) in ("yeah", "yes", "yep")
        assert wer(QUESTION, transcripts[1]["text"]) <= 0.2
        assert policy.ignored_backchannels == 1


async def test_a_silent_mic_never_barges_in():
    silence = np.zeros(16000 * 6, np.float32)
    async with two_way(clip_track(silence), listen={"barge_in": "speech", "transcribe": False}) as (
        call,
        caller,
    ):
        handle = call.speak("A short reply the caller listens to in silence.")
        done = await asyncio.wait_for(handle.done(), 20)
        assert done["type"] == "speech.done"
        assert not caller.of("user.speech.started") and call.counters()["barge_ins"] == 0
        assert call.listener is not None and call.listener.frames_received > 50
        receivers = [t.receiver for t in call.pc.getTransceivers() if t.kind == "audio"]
        # a missing mic packet is waited for by [listen] mic_jitter_frames (1) later ones, not aiortc's 4
        assert receivers[0]._RTCRtpReceiver__jitter_buffer.max_wait_frames == 1


async def test_the_agents_own_voice_on_the_mic_with_echo_cancelled_is_not_speech():
    # an echo canceller leaves a faint residue of the agent's voice: -50 dBFS of it is no barge-in
    pcm, _ = caller_clip([0.5, "This is the agent's own reply, heard back faintly.", 0.5])
    residue = pcm * (10 ** (-50 / 20) / max(1e-9, np.abs(pcm).max()))
    async with two_way(clip_track(residue), listen={"barge_in": "speech", "transcribe": False}) as (
        call,
        caller,
    ):
        handle = call.speak("Hello there, this is a reply.")
        assert (await asyncio.wait_for(handle.done(), 20))["type"] == "speech.done"
        await asyncio.sleep(1.0)
        assert not caller.of("user.speech.started")


async def test_video_is_ignored_and_said_so():
    silence = np.zeros(16000, np.float32)
    async with two_way(clip_track(silence), video=True, listen={"transcribe": False}) as (call, _caller):
        assert call.ignored_media == ["video"]
        video = call.pc.localDescription.sdp.split("m=video", 1)[1]
        assert "a=inactive" in video or video.split(" ", 1)[0] == "0"


async def test_a_mic_in_a_codec_we_do_not_take_is_refused_naming_it():
    config = fake_config(listen={"transcribe": False})
    engine = create_engine(config)
    call = Call("c1", engine, config)
    caller = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    caller.addTransceiver("audio", direction="sendrecv")
    await caller.setLocalDescription(await caller.createOffer())
    offer = g722_only(caller.localDescription.sdp)
    with pytest.raises(UnsupportedCodecError, match="G722"):
        await call.answer(offer)
    await caller.close()
    await call.close()
