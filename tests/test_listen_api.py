"""Listening for agents: `call.listen()` and user events in the embedding API, and the
`GET /v1/calls/{id}/audio` WebSocket (format, PCM frames, a stalled reader closed with 4008)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from call_helpers import fake_config
from listen_helpers import caller_clip, clip_track, g722_only

from signaling.audio_ws import CLOSE_STALLED
from signaling.embed import VoiceServer
from voicertc.webrtc import patch_aioice_loopback

QUESTION = "Could you book a table for two at seven?"


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


@contextlib.asynccontextmanager
async def server_and_caller(pcm: np.ndarray, **listen):
    config = fake_config(server={"port": 0}, listen={"transcribe": False, **listen})
    async with VoiceServer(config) as server:
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTrack(clip_track(pcm))
        pc.createDataChannel("events")
        await pc.setLocalDescription(await pc.createOffer())
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                f"{server.url}/v1/calls", json={"sdp": pc.localDescription.sdp, "type": "offer"}
            )
            assert resp.status == 201
            body = await resp.json()
        await pc.setRemoteDescription(RTCSessionDescription(sdp=body["sdp"], type="answer"))
        call = await server.next_call(timeout_s=10)
        try:
            yield server, call
        finally:
            await pc.close()


async def test_embedding_api_listen_and_user_events():
    pcm, spoken = caller_clip([0.5, QUESTION, 1.0])
    async with server_and_caller(pcm, barge_in="off") as (_server, call):
        frames: list[np.ndarray] = []
        async for frame in call.listen():
            frames.append(frame)
            if len(frames) * 20 >= 1000 * spoken[0].end_s:
                break
        assert all(f.dtype == np.int16 and f.size == 320 for f in frames)
        audio = np.concatenate(frames).astype(np.float32) / 32768
        onset = int(spoken[0].start_s * 16000)
        assert np.sqrt(np.mean(audio[onset : onset + 8000] ** 2)) > 0.01  # the question is in it
        kinds = []
        async for event in call.events():
            kinds.append(event["type"])
            if event["type"] == "user.speech.stopped":
                break
        assert "user.speech.started" in kinds


async def test_audio_websocket_streams_pcm16_frames():
    pcm, _ = caller_clip([0.3, QUESTION, 0.5])
    async with server_and_caller(pcm) as (server, call):
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{server.url}/v1/calls/{call.call_id}/audio") as ws:
                head = json.loads((await ws.receive(timeout=10)).data)
                assert head == {
                    "type": "audio.format",
                    "encoding": "pcm_s16le",
                    "sample_rate_hz": 16000,
                    "channels": 1,
                    "frame_ms": 20,
                    "call_id": call.call_id,
                }
                chunks = []
                while len(chunks) < 100:
                    message = await ws.receive(timeout=10)
                    assert message.type == aiohttp.WSMsgType.BINARY
                    chunks.append(message.data)
                assert {len(c) for c in chunks} == {640}
                audio = np.frombuffer(b"".join(chunks), "<i2").astype(np.float32) / 32768
                assert np.sqrt(np.mean(audio**2)) > 0.01
            await call.hang_up()


async def test_a_stalled_audio_reader_is_closed_with_4008_and_its_drops_counted():
    pcm, _ = caller_clip([0.2, QUESTION])
    async with server_and_caller(pcm, ws_stall_timeout_s=0.3) as (server, call):
        listener = call._call.listener
        async with aiohttp.ClientSession() as session:
            ws = await session.ws_connect(f"{server.url}/v1/calls/{call.call_id}/audio")
            await asyncio.sleep(0.5)  # connected: the tap exists
            for _ in range(300):  # never reading: the server gives up once it is 0.3 s behind
                if listener is not None and not listener._taps:
                    break
                await asyncio.sleep(0.1)
                listener = call._call.listener
            assert listener is not None and not listener._taps
            close = None
            while close is None:
                message = await ws.receive(timeout=10)
                if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                    close = ws.close_code
            assert close == CLOSE_STALLED
            await ws.close()
            metrics = await (await session.get(f"{server.url}/metrics")).text()
        assert "voicertc_inbound_dropped_frames_total" in metrics


async def test_audio_websocket_bad_requests():
    pcm = np.zeros(16000, np.float32)
    async with server_and_caller(pcm) as (server, call):
        async with aiohttp.ClientSession() as session:
            plain = await session.get(f"{server.url}/v1/calls/{call.call_id}/audio")
            assert plain.status == 426 and (await plain.json())["error"]["code"] == "upgrade_required"
            unknown = await session.get(f"{server.url}/v1/calls/nope/audio")
            assert unknown.status == 404
            spec = await (await session.get(f"{server.url}/openapi.json")).json()
            assert "/v1/calls/{call_id}/audio" in spec["paths"]


async def test_http_answer_says_video_is_ignored_and_refuses_an_unknown_mic_codec():
    config = fake_config(server={"port": 0}, listen={"transcribe": False})
    async with VoiceServer(config) as server, aiohttp.ClientSession() as session:
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTrack(clip_track(np.zeros(16000, np.float32)))
        pc.addTransceiver("video", direction="sendrecv")
        pc.createDataChannel("events")
        await pc.setLocalDescription(await pc.createOffer())
        offer = pc.localDescription.sdp
        resp = await session.post(f"{server.url}/v1/calls", json={"sdp": offer, "type": "offer"})
        assert resp.status == 201
        body = await resp.json()
        assert body["ignored_media"] == ["video"] and resp.headers["X-Ignored-Media"] == "video"
        bad = await session.post(f"{server.url}/v1/calls", json={"sdp": g722_only(offer), "type": "offer"})
        assert bad.status == 400
        assert "codec" in (await bad.json())["error"]["message"]  # named before anything is set up
        await pc.close()


async def test_user_events_reach_server_sent_events():
    pcm, _ = caller_clip([0.5, QUESTION, 1.0])
    async with server_and_caller(pcm, barge_in="off") as (server, call):
        async with aiohttp.ClientSession() as session:
            resp = await session.get(f"{server.url}/v1/calls/{call.call_id}/events")
            seen: list[str] = []

            async def read() -> None:
                async for line in resp.content:
                    if line.startswith(b"event: "):
                        seen.append(line[7:].decode().strip())
                        if seen[-1] == "user.speech.stopped":
                            return

            await asyncio.wait_for(read(), 20)
            resp.close()
        assert seen[:2] == ["user.speech.started", "user.speech.stopped"]
