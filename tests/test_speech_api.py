"""`POST /v1/audio/speech` driven by the real `openai` SDK against the server on loopback (fake engine;
the Piper voice and Whisper are in test_agents_whisper.py)."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import aiohttp
import av
import numpy as np
import openai
import pytest
from api_helpers import api
from openai._streaming import SSEDecoder

from signaling.app import ENGINE
from voicertc.engine.fake import MS_PER_CHAR

TEXT = "Hello there. This is the speech endpoint."
SLOW = {"fake": {"ttfa_ms": 20, "rtf": 1.0, "chunk_ms": 100}}  # real time: an utterance lasts seconds
LONG_TEXT = "This sentence is long enough to take several seconds to speak in real time. " * 3


def sdk(client, **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0, **kwargs)


def decoded_seconds(data: bytes) -> tuple[float, int]:
    """Duration and sample rate of an encoded stream, decoded with PyAV."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return samples / stream.rate, stream.rate


async def wait_closed_utterances(engine, timeout_s: float = 3.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if engine.open_count == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine still has {engine.open_count} open utterances")


async def test_every_response_format_decodes_to_the_spoken_length():
    async with api() as client:
        oa = sdk(client)
        pcm = (
            await oa.audio.speech.create(model="tts-1", input=TEXT, voice="tone", response_format="pcm")
        ).content
        pcm_s = len(pcm) / 2 / 24_000
        expected_s = MS_PER_CHAR * len(TEXT) / 1000  # the fake engine speaks 65 ms per character
        assert abs(pcm_s - expected_s) < 0.15 * expected_s, (pcm_s, expected_s)
        tone = np.frombuffer(pcm, "<i2")
        assert np.abs(tone).max() > 5000  # a tone, not silence
        for fmt in ("wav", "opus", "mp3", "flac", "aac"):
            data = (
                await oa.audio.speech.create(model="any", input=TEXT, voice="tone", response_format=fmt)
            ).content
            seconds, rate = decoded_seconds(data)
            assert abs(seconds - pcm_s) < 0.08, (fmt, seconds, pcm_s)
            assert rate in (24_000, 48_000), (fmt, rate)  # Ogg Opus decodes at 48 kHz
        await oa.close()


async def test_first_bytes_leave_before_the_utterance_ends():
    async with api(**SLOW) as client:
        engine = client.app[ENGINE]
        oa = sdk(client)
        async with oa.audio.speech.with_streaming_response.create(
            model="tts-1", input=LONG_TEXT, voice="alloy", response_format="pcm"
        ) as response:
            assert response.headers["X-Sample-Rate"] == "24000"
            assert float(response.headers["X-TTFB-Ms"]) >= 0
            first = b""
            async for chunk in response.iter_bytes():
                first = chunk
                break
            # the ordering: the first bytes are here while the engine still has the utterance open
            assert first and engine.open_count == 1
        await wait_closed_utterances(engine)  # leaving the block closed the connection: cancelled
        await oa.close()


async def test_sse_stream_parses_with_the_sdk_decoder():
    async with api() as client:
        oa = sdk(client)
        async with oa.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", input=TEXT, voice="tone", response_format="pcm", stream_format="sse"
        ) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            events = [json.loads(sse.data) async for sse in SSEDecoder().aiter_bytes(response.iter_bytes())]
        await oa.close()
    assert events[-1] == {"type": "speech.audio.done"}
    deltas = events[:-1]
    assert deltas and all(e["type"] == "speech.audio.delta" for e in deltas)
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert abs(len(pcm) / 48_000 - MS_PER_CHAR * len(TEXT) / 1000) < 0.3


async def test_refusals_are_the_sdk_error_types_with_our_codes():
    async with api(limits={"max_text_chars": 50}) as client:
        engine = client.app[ENGINE]
        oa = sdk(client)
        cases = [
            ({"input": TEXT, "voice": "nobody"}, openai.BadRequestError, "unknown_voice", "voice"),
            ({"input": "  ", "voice": "tone"}, openai.BadRequestError, "bad_input", "input"),
            ({"input": "x" * 51, "voice": "tone"}, openai.APIStatusError, "text_too_long", "input"),
            ({"input": "bad \x00 text", "voice": "tone"}, openai.BadRequestError, "bad_text", "input"),
            ({"input": TEXT, "voice": "tone", "response_format": "ogg"}, openai.BadRequestError,
             "bad_request", "response_format"),
            ({"input": TEXT, "voice": "tone", "instructions": "Cheerfully."}, openai.BadRequestError,
             "not_supported", "instructions"),
            ({"input": TEXT, "voice": "tone", "speed": 1.5}, openai.BadRequestError, "speed_not_supported",
             "speed"),
        ]  # fmt: skip
        for kwargs, error_type, code, param in cases:
            with pytest.raises(error_type) as caught:
                await oa.audio.speech.create(model="tts-1", **kwargs)
            assert caught.value.code == code, (kwargs, caught.value.body)
            assert caught.value.param == param and caught.value.type == "invalid_request_error"
            assert isinstance(caught.value.body, dict) and caught.value.body["message"]
        assert caught.type is openai.BadRequestError
        too_long = await client.post("/v1/audio/speech", json={"input": "x" * 51, "voice": "tone"})
        assert too_long.status == 413
        bad_json = await client.post(
            "/v1/audio/speech", data=b"{nope", headers={"Content-Type": "application/json"}
        )
        assert bad_json.status == 400 and (await bad_json.json())["error"]["code"] == "bad_json"
        assert engine.open_count == 0 and engine.stats["utterances"] == 0  # nothing was queued
        await oa.close()


async def test_auth_and_engine_busy_as_the_rest_of_v1():
    async with api(auth={"tokens": ["sekret"]}, limits={"max_utterances": 1}, **SLOW) as client:
        with pytest.raises(openai.PermissionDeniedError) as denied:  # the SDK always sends its key
            await sdk(client).audio.speech.create(model="m", input=TEXT, voice="tone")
        assert denied.value.code == "forbidden"
        no_token = await client.post("/v1/audio/speech", json={"input": TEXT})
        assert no_token.status == 401 and (await no_token.json())["error"]["code"] == "unauthorized"
        oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="sekret", max_retries=0)
        # the first utterance holds the engine's only slot while its client reads (leaving an SDK
        # iterator early closes the response, so this reader is plain aiohttp)
        body = {"input": LONG_TEXT, "voice": "tone", "response_format": "pcm"}
        first = await client.post("/v1/audio/speech", json=body, headers={"Authorization": "Bearer sekret"})
        assert first.status == 200 and await first.content.readany()
        with pytest.raises(openai.RateLimitError) as caught:
            await oa.audio.speech.create(model="m", input=TEXT, voice="tone")
        assert caught.value.code == "engine_busy"
        assert caught.value.response.headers["Retry-After"] == "1"
        first.close()
        await wait_closed_utterances(client.app[ENGINE])
        await oa.close()


async def test_a_dropped_connection_frees_the_engine_at_once():
    async with api(**SLOW) as client:
        engine = client.app[ENGINE]
        url = client.make_url("/v1/audio/speech")
        # raw HTTP: read the head and a piece of the body, then drop the socket without reading more
        reader, writer = await asyncio.open_connection(url.host, url.port)
        body = json.dumps({"model": "tts-1", "input": LONG_TEXT, "voice": "tone", "response_format": "pcm"})
        writer.write(
            f"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        await reader.read(1024)
        assert engine.open_count == 1
        writer.close()
        await wait_closed_utterances(engine, timeout_s=1.0)  # seconds before the utterance would end
        for _ in range(50):  # the worker counts the cancel when it applies it (open_count drops first)
            if engine.stats["cancelled"] == 1:
                break
            await asyncio.sleep(0.02)
        assert engine.stats["cancelled"] == 1


async def test_openapi_covers_the_new_routes():
    async with api() as client:
        spec = await (await client.get("/openapi.json")).json()
    assert "post" in spec["paths"]["/v1/audio/speech"]
    assert "get" in spec["paths"]["/v1/tts/stream"]


@pytest.mark.expected_errors("fake engine failure")
async def test_a_failure_before_audio_is_an_http_error_and_after_it_a_cut_connection():
    async with api(fake={"fail_after_chunks": 0}) as client:
        oa = sdk(client)
        with pytest.raises(openai.InternalServerError) as caught:
            await oa.audio.speech.create(model="m", input=TEXT, voice="tone", response_format="pcm")
        assert caught.value.code == "synthesis_error" and caught.value.type == "server_error"
        await oa.close()
    async with api(fake={"fail_after_chunks": 1, "chunk_ms": 100}) as client:
        resp = await client.post(
            "/v1/audio/speech", json={"input": TEXT, "voice": "tone", "response_format": "wav"}
        )
        assert resp.status == 200  # the first chunk had left
        with pytest.raises(aiohttp.ClientPayloadError):  # not a complete-looking, truncated file
            await resp.read()
        assert client.app[ENGINE].open_count == 0
