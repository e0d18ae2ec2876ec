"""`GET /v1/tts/stream`: text deltas in, audio out, over a real aiohttp WebSocket client (fake engine)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import aiohttp
from api_helpers import api

from signaling.app import ENGINE
from voicertc.engine.fake import MS_PER_CHAR

SLOW = {"fake": {"ttfa_ms": 20, "rtf": 1.0, "chunk_ms": 100}}  # real time: an utterance lasts seconds
PIECES = ["Hello the", "re, how are ", "you today?"]


async def until_done(ws: Any, timeout_s: float = 10.0) -> tuple[list[dict[str, Any]], bytes]:
    """Messages (JSON) and binary audio up to the next speech.done or utterance error."""
    events: list[dict[str, Any]] = []
    audio = b""
    async with asyncio.timeout(timeout_s):
        while True:
            message = await ws.receive()
            if message.type == aiohttp.WSMsgType.BINARY:
                audio += message.data
                continue
            assert message.type == aiohttp.WSMsgType.TEXT, message
            event = message.json()
            events.append(event)
            if event["type"] == "speech.done" or (event["type"] == "error" and "utterance_id" in event):
                return events, audio


async def next_json(ws: Any) -> dict[str, Any]:
    async with asyncio.timeout(5):
        return await ws.receive_json()


def spoken_ms(text: str) -> float:
    return MS_PER_CHAR * len(text)


async def test_three_deltas_speak_as_one_sentence():
    async with api() as client, client.ws_connect("/v1/tts/stream") as ws:
        created = await next_json(ws)
        assert created["type"] == "session.created"
        assert created["session"]["format"] == "pcm_s16le" and created["session"]["sample_rate"] == 24000
        for piece in PIECES:
            await ws.send_json({"type": "text.delta", "text": piece})
        await ws.send_json({"type": "text.flush"})
        events, audio = await until_done(ws)
    marks = [e for e in events if e["type"] == "speech.mark"]
    events = [e for e in events if e["type"] != "speech.mark"]
    kinds = [e["type"] for e in events]
    assert kinds == ["speech.queued", "speech.started", "speech.done"], kinds
    assert len({e["utterance_id"] for e in [*events, *marks]}) == 1
    assert events[1]["ttfa_ms"] >= 0 and events[2]["interrupted"] is False
    audio_ms = len(audio) / 48.0
    assert abs(audio_ms - spoken_ms("".join(PIECES))) < 100, audio_ms
    assert abs(events[2]["audio_ms"] - audio_ms) < 1
    # text marks: the engine's pieces in order, each placed where its audio starts
    assert " ".join(m["text"] for m in marks).split() == "".join(PIECES).split()
    starts = [m["audio_ms"] for m in marks]
    assert starts[0] == 0 and starts == sorted(starts) and starts[-1] < audio_ms


async def test_a_delta_with_flush_is_a_whole_utterance_in_one_message():
    async with api() as client, client.ws_connect("/v1/tts/stream") as ws:
        await next_json(ws)
        await ws.send_json({"type": "text.delta", "text": "All of it at once.", "flush": True})
        events, audio = await until_done(ws)
        assert events[-1]["type"] == "speech.done" and events[-1]["interrupted"] is False
        assert abs(len(audio) / 48.0 - spoken_ms("All of it at once.")) < 100
        await ws.send_json({"type": "text.delta", "text": "x", "flush": "yes"})
        assert (await next_json(ws))["code"] == "bad_request"


async def test_cancel_stops_within_one_chunk_and_the_next_delta_speaks():
    long_text = "This is a long sentence that takes many seconds to speak. " * 3
    async with api(**SLOW) as client, client.ws_connect("/v1/tts/stream") as ws:
        engine = client.app[ENGINE]
        await next_json(ws)
        await ws.send_json({"type": "text.delta", "text": long_text})
        await ws.send_json({"type": "text.flush"})
        assert (await next_json(ws))["type"] == "speech.queued"
        assert (await next_json(ws))["type"] == "speech.started"
        first = await ws.receive()
        while first.type == aiohttp.WSMsgType.TEXT and first.json()["type"] == "speech.mark":
            first = await ws.receive()
        assert first.type == aiohttp.WSMsgType.BINARY
        await ws.send_json({"type": "cancel"})
        events, after_cancel = await until_done(ws)
        assert events[-1]["type"] == "speech.done" and events[-1]["interrupted"] is True
        chunk_bytes = 2 * 24_000 * SLOW["fake"]["chunk_ms"] // 1000
        assert len(after_cancel) <= chunk_bytes, len(after_cancel)  # at most one engine chunk
        assert engine.open_count == 0
        # the session goes on: the next text speaks, as a new utterance
        await ws.send_json({"type": "text.delta", "text": "Next one."})
        await ws.send_json({"type": "text.flush"})
        events, audio = await until_done(ws)
        kinds = [e["type"] for e in events if e["type"] != "speech.mark"]
        assert kinds == ["speech.queued", "speech.started", "speech.done"]
        assert abs(len(audio) / 48.0 - spoken_ms("Next one.")) < 100


async def test_two_sessions_at_once_each_hear_their_own_text():
    texts = ["Short one.", "This one is a good deal longer than the other."]
    async with api() as client:

        async def session(text: str) -> tuple[list[dict[str, Any]], bytes]:
            async with client.ws_connect("/v1/tts/stream") as ws:
                await next_json(ws)
                await ws.send_json({"type": "text.delta", "text": text})
                await ws.send_json({"type": "text.flush"})
                return await until_done(ws)

        results = await asyncio.gather(*(session(t) for t in texts))
    for text, (events, audio) in zip(texts, results, strict=True):
        assert events[-1]["type"] == "speech.done"
        assert abs(len(audio) / 48.0 - spoken_ms(text)) < 100, (text, len(audio))


async def test_bad_messages_get_errors_and_the_session_survives():
    async with api(limits={"max_text_chars": 200}) as client, client.ws_connect("/v1/tts/stream") as ws:
        await next_json(ws)
        await ws.send_str("{not json")
        assert (await next_json(ws))["code"] == "bad_json"
        await ws.send_json({"type": "speak.please"})
        assert (await next_json(ws))["code"] == "unknown_type"
        await ws.send_bytes(b"\x00\x01")
        assert (await next_json(ws))["code"] == "binary_not_accepted"
        await ws.send_json({"type": "text.delta", "text": "bad \x00"})
        assert (await next_json(ws))["code"] == "bad_text"
        await ws.send_json({"type": "session.update", "voice": "nobody"})
        assert (await next_json(ws))["code"] == "unknown_voice"
        await ws.send_json({"type": "session.update", "sample_rate": 12345})
        assert (await next_json(ws))["code"] == "bad_request"
        await ws.send_json({"type": "session.update", "instruct": "Whisper it."})
        assert (await next_json(ws))["code"] == "not_supported"
        # an utterance over the text limit fails alone
        await ws.send_json({"type": "text.delta", "text": "x" * 150})
        await ws.send_json({"type": "text.delta", "text": "y" * 60})
        events, _ = await until_done(ws)
        assert events[-1]["type"] == "error" and events[-1]["code"] == "text_too_long"
        # still alive: settings apply, text speaks (16 kHz, base64 JSON audio)
        await ws.send_json(
            {"type": "session.update", "sample_rate": 16000, "binary": False, "voice": "alloy"}
        )
        updated = await next_json(ws)
        assert updated["type"] == "session.updated" and updated["session"]["sample_rate"] == 16000
        await ws.send_json({"type": "text.delta", "text": "Still here."})
        await ws.send_json({"type": "text.flush"})
        events, binary = await until_done(ws)
        assert not binary
        audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
        assert abs(len(audio) / 32.0 - spoken_ms("Still here.")) < 100
        # a message over the size limit closes the socket with 1009 (documented)
        await ws.send_str('{"type": "text.delta", "text": "' + "z" * 10_000 + '"}')
        closing = await ws.receive()
        assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        assert ws.close_code == 1009


async def test_queued_utterances_are_bounded_per_session():
    async with (
        api(limits={"max_queued_utterances": 2}, **SLOW) as client,
        client.ws_connect("/v1/tts/stream") as ws,
    ):
        await next_json(ws)
        for text in ("One is speaking.", "Two waits."):
            await ws.send_json({"type": "text.delta", "text": text})
            await ws.send_json({"type": "text.flush"})
        await ws.send_json({"type": "text.delta", "text": "Three is refused."})
        async with asyncio.timeout(5):
            while True:
                message = await ws.receive()
                if message.type == aiohttp.WSMsgType.TEXT and message.json()["type"] == "error":
                    event = message.json()
                    break
        assert event["code"] == "too_many_utterances" and "utterance_id" not in event
        assert client.app[ENGINE].open_count == 1  # one open in the engine, one waiting for its turn


async def test_an_idle_session_is_closed_with_4408():
    async with api(limits={"text_idle_timeout_s": 0.3}) as client, client.ws_connect("/v1/tts/stream") as ws:
        await next_json(ws)
        event = await next_json(ws)
        assert event["type"] == "error" and event["code"] == "idle_timeout"
        closing = await ws.receive()
        assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        assert ws.close_code == 4408


async def test_closing_the_socket_cancels_its_utterances_and_auth_applies():
    async with api(auth={"tokens": ["sekret"]}, **SLOW) as client:
        engine = client.app[ENGINE]
        refused = await client.get("/v1/tts/stream")
        assert refused.status == 401
        headers = {"Authorization": "Bearer sekret"}
        async with client.ws_connect("/v1/tts/stream", headers=headers) as ws:
            await next_json(ws)
            await ws.send_json({"type": "text.delta", "text": "A long utterance that is still going. " * 4})
            await ws.send_json({"type": "text.flush"})
            await next_json(ws)
            await next_json(ws)
            assert engine.open_count == 1
        for _ in range(100):
            if engine.open_count == 0:
                break
            await asyncio.sleep(0.02)
        assert engine.open_count == 0


async def test_the_client_opens_a_new_socket_after_an_idle_close():
    from voicertc.integrations.ws_client import TtsStreamClient

    async with api(limits={"text_idle_timeout_s": 0.3}) as client:
        stream = TtsStreamClient(str(client.make_url("/")))
        for text in ("Before the pause.", "After the pause."):
            utterance = stream.utterance()
            await utterance.push(text)
            await utterance.flush()
            pcm = b"".join([chunk async for chunk in utterance.audio()])
            assert abs(len(pcm) / 48.0 - spoken_ms(text)) < 100
            assert utterance.marks and utterance.marks[0][1] == 0.0
            await asyncio.sleep(0.8)  # the server closes the idle socket (4408)
        await stream.close()
