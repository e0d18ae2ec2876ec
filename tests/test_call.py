"""Call: a real aiortc peer on loopback hears the FakeEngine's tone; order, interrupt, liveness, cleanup."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from call_helpers import PeerClient, fake_config, rms

from voicertc.engine.factory import create_engine
from voicertc.webrtc import patch_aioice_loopback
from voicertc.webrtc.call import Call, CallClosedError


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


@contextlib.asynccontextmanager
async def call_pair(**sections):
    config = fake_config(**sections)
    engine = create_engine(config)
    engine.start()
    call = Call("c1", engine, config)
    client = PeerClient()
    try:
        answer = await call.answer(await client.offer())
        await client.accept(answer)
        await client.wait_open()
        yield call, client, engine
    finally:
        await client.close()
        await call.close("test over")
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)


async def test_speak_plays_audio_then_done():
    async with call_pair() as (call, client, _engine):
        handle = call.speak("Hello there, this is a test.")
        started = await client.wait_event("speech.started", utterance_id=handle.utterance_id)
        done = await handle.done()
        assert done["type"] == "speech.done"
        assert started["ttfa_ms"] > 0
        # 28 characters at the fake's 65 ms per character
        assert done["played_ms"] == pytest.approx(28 * 65, rel=0.05)
        await asyncio.sleep(0.3)  # frames in flight
        assert rms(client.audio()) > 0.05
        assert (await client.wait_event("speech.done"))["utterance_id"] == handle.utterance_id


async def test_utterances_of_one_call_play_in_order():
    async with call_pair() as (call, client, _engine):
        first = call.speak("First sentence here.")
        second = call.speak("Second one.")
        await second.done()
        assert first.finished
        await client.wait_event("speech.done", utterance_id=second.utterance_id)
        kinds = [(e["type"], e["utterance_id"]) for e in client.events if e["type"].startswith("speech.")]
        assert kinds == [
            ("speech.started", first.utterance_id),
            ("speech.done", first.utterance_id),
            ("speech.started", second.utterance_id),
            ("speech.done", second.utterance_id),
        ]


async def test_streamed_deltas_speak_one_utterance():
    async def deltas():
        for word in ["Streaming ", "text ", "from ", "an ", "agent."]:
            yield word
            await asyncio.sleep(0.02)

    async with call_pair() as (call, _client, _engine):
        handle = call.speak(deltas())
        done = await handle.done()
        assert done["type"] == "speech.done"
        assert done["played_ms"] == pytest.approx(len("Streaming text from an agent.") * 65, rel=0.05)


async def test_interrupt_stops_audio_and_drops_the_queue():
    async with call_pair() as (call, client, _engine):
        long = call.speak("This is a long utterance. " * 20)
        queued = call.speak("Never heard.")
        await client.wait_event("speech.started", utterance_id=long.utterance_id)
        await asyncio.sleep(0.5)
        utterance_id, played_ms = call.interrupt()
        assert utterance_id == long.utterance_id
        assert 300 < played_ms < 3000
        assert (await long.done()) == {
            "type": "speech.interrupted",
            "utterance_id": long.utterance_id,
            "played_ms": round(played_ms, 1),
        }
        assert (await queued.done())["played_ms"] == 0.0
        await asyncio.sleep(0.4)  # the fade and frames in flight
        heard = len(client.pcm)
        await asyncio.sleep(0.4)
        assert rms(client.audio()[heard * 960 :]) < 1e-3
        assert call.speech.pending == 0


async def test_data_channel_speak_interrupt_and_bad_messages():
    async with call_pair() as (call, client, _engine):
        client.send({"type": "speak", "text": "Hello from the data channel. " * 10})
        queued = await client.wait_event("speech.queued")
        await client.wait_event("speech.started", utterance_id=queued["utterance_id"])
        client.send({"type": "interrupt"})
        cut = await client.wait_event("speech.interrupted")
        assert cut["utterance_id"] == queued["utterance_id"]
        client.channel.send("not json")
        assert (await client.wait_event("error"))["code"] == "bad_message"
        client.send({"type": "ping", "ts": 1})
        assert (await client.wait_event("pong"))["ts"] == 1
        assert not call.closed.is_set()


async def test_engine_failure_is_an_error_event_and_the_call_stays_up():
    async with call_pair(fake={"fail_after_chunks": 1}) as (call, client, _engine):
        handle = call.speak("This will fail after one chunk of audio, for sure. " * 3)
        event = await handle.done()
        assert event["type"] == "error" and event["code"] == "synthesis_error"
        assert (await client.wait_event("error"))["utterance_id"] == handle.utterance_id
        assert not call.closed.is_set()


async def test_a_peer_that_vanishes_is_freed():
    async with call_pair() as (call, client, engine):
        call.speak("Talking to nobody for a while. " * 20)
        await client.wait_event("speech.started")
        await client.pc.close()  # DTLS close: the server notices
        await asyncio.wait_for(call.closed.wait(), 10)
        assert call.speech.pending == 0
        assert call.ring.queued_samples == 0
        await asyncio.sleep(0.3)
        assert engine._open_count == 0


async def test_keepalive_timeout_closes_a_silent_data_channel():
    async with call_pair(webrtc={"keepalive_timeout_s": 1.0}) as (call, client, _engine):
        client.send({"type": "ping"})
        await client.wait_event("pong")
        await asyncio.wait_for(call.closed.wait(), 5)
        assert call.close_reason == "keepalive timeout"


async def test_a_call_that_never_connects_is_closed():
    config = fake_config(webrtc={"connect_timeout_s": 1.0})
    engine = create_engine(config)
    call = Call("c2", engine, config)
    client = PeerClient()
    try:
        await call.answer(await client.offer())  # the client never applies the answer
        await asyncio.wait_for(call.closed.wait(), 5)
        assert call.close_reason == "connect timeout"
        with pytest.raises(CallClosedError):
            call.speak("Too late.")
    finally:
        await client.close()
        await call.close()
