"""Agent embedding: VoiceServer in-process, an aiortc peer calls in over HTTP, Python speaks deltas."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import aiohttp
import pytest
from call_helpers import PeerClient, fake_config, rms

import voicertc.config
from signaling.embed import VoiceServer
from voicertc.errors import ConfigError
from voicertc.webrtc import patch_aioice_loopback

README = Path(__file__).resolve().parents[1] / "README.md"


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
        peer.location = resp.headers["Location"]  # type: ignore[attr-defined]
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
        assert server.calls() == [call]  # the same AgentCall, not a new subscriber each time
        events = call.events()
        utt = call.say(llm_deltas())
        done = await utt.done()
        assert done["type"] == "speech.done" and done["utterance_id"] == utt.utterance_id
        assert done["played_ms"] == pytest.approx(
            len("The agent streams its answer word by word.") * 65, rel=0.05
        )
        kinds = [(await anext(events))["type"] for _ in range(3)]
        assert kinds == ["speech.queued", "speech.started", "speech.done"]
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


def readme_embedding_example() -> str:
    section = README.read_text().split("## Embedding in an agent", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


async def test_the_readme_embedding_example_runs_as_written(monkeypatch):
    monkeypatch.setattr(voicertc.config, "load_config", lambda _path: fake_config(server={"port": 0}))
    code = readme_embedding_example()
    assert code.rstrip().endswith("asyncio.run(main())")
    printed: list[tuple] = []
    namespace = {"print": lambda *args: printed.append(args)}
    exec(compile(code.rstrip().removesuffix("asyncio.run(main())"), str(README), "exec"), namespace)
    agent = asyncio.ensure_future(namespace["main"]())
    for _ in range(100):
        if printed or agent.done():
            break
        await asyncio.sleep(0.05)
    url = printed[0][1]
    peer = await dial(url)
    try:
        for _ in range(200):
            if sum(e["type"] == "speech.done" for e in peer.events) == 2:
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as session:
            assert (await session.delete(f"{url}{peer.location}")).status == 200
        await asyncio.wait_for(agent, 10)  # the events loop ends with the call
    finally:
        await peer.close()
        if not agent.done():
            agent.cancel()
    kinds = [args[0]["type"] for args in printed[1:]]
    assert kinds == ["speech.queued", "speech.started", "speech.done"] * 2


async def test_start_is_idempotent_and_a_busy_port_is_a_clear_error():
    async with VoiceServer(fake_config(server={"port": 0})) as server:
        assert await server.start() == server.url  # inside async with: no second bind
        port = int(server.url.rsplit(":", 1)[1])
        busy = VoiceServer(fake_config(server={"port": port}))
        with pytest.raises(ConfigError, match="server.port"):
            await busy.start()
        assert not busy.engine.running  # the engine it started is stopped again
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # and the first one let its port go
