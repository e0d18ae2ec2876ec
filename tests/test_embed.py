"""Agent embedding: VoiceServer in-process, an aiortc peer calls in over HTTP, Python speaks deltas."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from call_helpers import PeerClient, fake_config, rms

from signaling.embed import VoiceServer
from voicertc.webrtc import patch_aioice_loopback


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


async def dial(url: str) -> PeerClient:
    peer = PeerClient()
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            f"{url}/v1/calls", data=await peer.offer(), headers={"Content-Type": "application/sdp"}
        )
        assert resp.status == 201
        await peer.accept(await resp.text())
    await peer.wait_open()
    return peer


async def llm_deltas():
    for delta in ["The agent ", "streams ", "its answer ", "word by word", "."]:
        await asyncio.sleep(0.03)
        yield delta


async def test_agent_speaks_streamed_deltas_into_a_call():
    server = VoiceServer(fake_config(server={"port": 0}))
    url = await server.start()
    peer = await dial(url)
    try:
        call = await server.next_call(timeout_s=5)
        events = call.events()
        utt = call.say(llm_deltas())
        done = await utt.done()
        assert done["type"] == "speech.done" and done["utterance_id"] == utt.utterance_id
        assert done["played_ms"] == pytest.approx(
            len("The agent streams its answer word by word.") * 65, rel=0.05
        )
        assert [(await anext(events))["type"] for _ in range(2)] == ["speech.started", "speech.done"]
        await asyncio.sleep(0.3)
        assert rms(peer.audio()) > 0.05

        long = call.say("A long answer that the user talks over. " * 10)
        await peer.wait_event("speech.started", utterance_id=long.utterance_id)
        utterance_id, played_ms = call.interrupt()
        assert utterance_id == long.utterance_id and played_ms > 0
        assert (await long.done())["type"] == "speech.interrupted"
    finally:
        await peer.close()
        await server.stop()
    assert call.closed
    assert [e async for e in events][-1]["type"] == "speech.interrupted"  # then the stream ends


async def test_stop_closes_calls_and_the_engine():
    server = VoiceServer(fake_config(server={"port": 0}))
    url = await server.start()
    peer = await dial(url)
    call = await server.next_call(timeout_s=5)
    call.say("Talking while the server stops. " * 10)
    engine = server.engine
    assert engine.running
    await server.stop()
    assert not engine.running
    await peer.close()
    assert call.closed and call.state == "closed"
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as session:
            await session.get(f"{url}/healthz")
