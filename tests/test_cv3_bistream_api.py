"""CosyVoice3 bistream end to end: text deltas over `GET /v1/tts/stream` reach the v3 LLM as they arrive.

The server runs the real `cosyvoice3` engine on the tiny speaking v3 directory
(`bench.make_tiny_model_dir --version 3`), whose LLM never samples a stop id while they are masked and
stops at once where they are not. So an utterance streamed as deltas says exactly 15 speech tokens per
full group of 5 text tokens (the 5:15 mixing rule; the < 5 text tokens left at the end are fed with
task_id and say nothing), audio starts before the text ends, and whole text (one LLM call per piece,
stopping at the minimum length) says 2 tokens per text token instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from bench.make_tiny_cv3_model_dir import make_tiny_cv3_model_dir
from bench.make_tiny_model_dir import SFT_VOICE
from signaling.app import create_app
from voicertc.backends.cosyvoice.voice.text_v3 import TextFrontendV3
from voicertc.config import config_from_dict

FIRST = "This is the first sentence of many. And "
REST = "then it ends."
BYTES_PER_TOKEN = 960 * 2  # 2 mel frames x 480 samples, 16-bit


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_cv3_model_dir(tmp_path_factory.mktemp("cv3_bistream_api"))


@pytest.fixture(scope="module")
def encode(model_dir):
    return TextFrontendV3(model_dir / "CosyVoice-BlankEN").encode


@contextlib.asynccontextmanager
async def serve(model_dir: Path, voices_dir: Path) -> AsyncIterator[TestClient]:
    config = config_from_dict(
        {
            "engine": {
                "backend": "cosyvoice3",
                "model_dir": str(model_dir),
                "voices_dir": str(voices_dir),
                "default_voice": SFT_VOICE,
            },
            "webrtc": {"loopback_only": True},
        }
    )
    client = TestClient(TestServer(create_app(config)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def receive(ws: Any, timeout_s: float = 300.0) -> tuple[dict[str, Any] | None, bytes]:
    async with asyncio.timeout(timeout_s):
        message = await ws.receive()
    if message.type == aiohttp.WSMsgType.BINARY:
        return None, message.data
    assert message.type == aiohttp.WSMsgType.TEXT, message
    return message.json(), b""


async def until(ws: Any, kind: str) -> tuple[list[dict[str, Any]], bytes]:
    """Events (marks dropped) and audio up to and including the first `kind` event."""
    events: list[dict[str, Any]] = []
    audio = b""
    while True:
        event, data = await receive(ws)
        audio += data
        if event is None or event["type"] == "speech.mark":
            continue
        assert event["type"] != "error", event
        events.append(event)
        if event["type"] == kind:
            return events, audio


async def test_deltas_speak_as_they_arrive_with_the_5_15_rule(model_dir, encode, tmp_path):
    spoken = len(encode("This is the first sentence of many.")) + len(encode("And then it ends."))
    first_sentence = len(encode("This is the first sentence of many."))
    async with serve(model_dir, tmp_path) as client, client.ws_connect("/v1/tts/stream") as ws:
        assert (await receive(ws))[0]["type"] == "session.created"  # type: ignore[index]
        await ws.send_json({"type": "text.delta", "text": FIRST})
        events, before_end = await until(ws, "speech.started")  # the text has not ended
        assert [e["type"] for e in events] == ["speech.queued", "speech.started"]
        while not before_end:  # audio while the text is still open: the first sentence's groups
            event, data = await receive(ws)
            assert event is None or event["type"] == "speech.mark", event
            before_end += data
        await ws.send_json({"type": "text.delta", "text": REST})
        await ws.send_json({"type": "text.flush"})
        events, after = await until(ws, "speech.done")
    audio = before_end + after
    assert 15 * (first_sentence // 5) * BYTES_PER_TOKEN >= len(before_end)
    assert len(audio) == 15 * (spoken // 5) * BYTES_PER_TOKEN, (len(audio), spoken)
    assert events[-1]["interrupted"] is False and abs(events[-1]["audio_ms"] - len(audio) / 48) < 1


async def test_whole_text_on_the_same_socket_is_unistream(model_dir, encode, tmp_path):
    text = "All of it at once."
    async with serve(model_dir, tmp_path) as client, client.ws_connect("/v1/tts/stream") as ws:
        await receive(ws)
        await ws.send_json({"type": "text.delta", "text": text, "flush": True})
        _, audio = await until(ws, "speech.done")
    assert len(audio) == 2 * len(encode(text)) * BYTES_PER_TOKEN


async def test_speech_starts_mid_sentence_from_the_words_completed_so_far(model_dir, encode, tmp_path):
    """Words leave for the LLM as they complete (`SentenceStream(words=True)`): no sentence end needed."""
    pieces = ["This is the first sentence", " of many.", " Bye."]  # as the stream cuts the deltas below
    spoken = sum(len(encode(p)) for p in pieces)
    groups = len(encode(pieces[0])) // 5  # of 5 text tokens, each saying 15 speech tokens
    assert groups >= 1
    async with serve(model_dir, tmp_path) as client, client.ws_connect("/v1/tts/stream") as ws:
        await receive(ws)
        await ws.send_json({"type": "text.delta", "text": "This is the first sentence of"})
        _, before = await until(ws, "speech.started")  # "of" may still grow: the rest is in
        while not before:  # audio while the sentence is still open (the chunks its groups allow)
            event, data = await receive(ws)
            assert event is None or event["type"] == "speech.mark", event
            before += data
        await ws.send_json({"type": "text.delta", "text": " many. Bye.", "flush": True})
        events, after = await until(ws, "speech.done")
    assert 0 < len(before) <= 15 * groups * BYTES_PER_TOKEN
    assert len(before + after) == 15 * (spoken // 5) * BYTES_PER_TOKEN, spoken
