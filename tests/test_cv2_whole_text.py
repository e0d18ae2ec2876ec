"""A whole text reaches the engine thread with its end in one command, so it is spoken as a whole text
(the official `inference_*` path: sentences, a minimum length) and never, by the threads' timing, as a
stream of deltas (the bistream LLM). CI once caught the difference: a replica heard "Hello." and, some
of the time, its end one engine step later, and spoke nothing.

The directory is `bench.make_tiny_model_dir`'s speaking one: eos is sampled the moment it is allowed, so
a whole "Hello." (2 text tokens) lasts exactly 4 speech tokens = 160 ms, while as deltas it makes no
speech (fewer than 5 text tokens make no group before the text ends, and these weights end at once
after it). The engine's command queue is made to give the engine thread a step after every command,
the worst timing two commands sent back to back can meet.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from call_helpers import fake_config

from bench.make_tiny_model_dir import make_tiny_model_dir
from signaling.app import create_app
from voicertc.assemble import create_local_engine
from voicertc.audio import PcmRing, RingSink
from voicertc.engine.protocol import Cancelled, Done, EngineEvent, Failed
from voicertc.streaming import SpeechStream

WHOLE_HELLO_MS = 160.0  # 2 text tokens x 2 speech tokens x 40 ms


class StepAfterEachCommand(queue.SimpleQueue):  # type: ignore[type-arg]
    """Every put from another thread returns only once the engine thread has taken the command and had
    time for a step (the engine thread's own puts, a wake-up after a release, return at once: they
    waited for themselves until the deadline, 5 s each)."""

    consumer: int | None = None  # the engine thread (the one that gets)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        self.consumer = threading.get_ident()
        return super().get(block, timeout)

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        if threading.get_ident() == self.consumer:
            return
        deadline = time.monotonic() + 5.0
        while not self.empty() and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(0.15)  # the engine applies it and runs the utterance's next unit meanwhile


def server_config(model_dir):
    return fake_config(engine={"backend": "cosyvoice2", "model_dir": str(model_dir), "text_workers": 0})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_model_dir):
    return make_tiny_model_dir(tmp_path_factory.mktemp("cv2_whole"), checkpoints_from=tiny_model_dir)


@pytest.fixture(scope="module")
def engine(model_dir) -> Iterator[Any]:
    eng = create_local_engine(server_config(model_dir))
    eng._queue = StepAfterEachCommand()  # before the thread starts: it reads only this queue
    eng.start()
    try:
        yield eng
    finally:
        eng.stop()


class Outcome:
    def __init__(self) -> None:
        self.events: list[EngineEvent] = []
        self.done = threading.Event()

    def __call__(self, event: EngineEvent) -> None:
        self.events.append(event)
        if isinstance(event, Done | Failed | Cancelled):
            self.done.set()

    def terminal(self) -> EngineEvent:
        assert self.done.wait(60.0), self.events
        return self.events[-1]


def sink() -> RingSink:
    return RingSink(PcmRing(48000 * 10))


def test_say_is_spoken_whole_however_late_the_engine_thread_looks(engine):
    outcome = Outcome()
    engine.say(None, sink(), outcome, "Hello.")
    event = outcome.terminal()
    assert isinstance(event, Done) and event.audio_ms == WHOLE_HELLO_MS, outcome.events


def test_push_with_end_is_one_command_and_a_separate_end_is_a_stream(engine):
    whole, deltas = Outcome(), Outcome()
    uid = engine.open_utterance(None, sink(), whole)
    engine.push_text(uid, "Hello.", end=True)
    uid = engine.open_utterance(None, sink(), deltas)
    engine.push_text(uid, "Hello.")  # the engine starts it as deltas before the end arrives
    engine.end_input(uid)
    event = whole.terminal()
    assert isinstance(event, Done) and event.audio_ms == WHOLE_HELLO_MS, whole.events
    event = deltas.terminal()
    assert isinstance(event, Done) and event.audio_ms == 0.0, deltas.events


async def test_the_speech_stream_pushes_a_whole_text_whole(engine):
    """The path of `POST /v1/audio/speech` and the in-process `say`."""
    stream = SpeechStream(engine, voice=None, options=None, sample_rate_hz=24000)
    stream.open()
    await asyncio.to_thread(stream.push, "Hello.", True)
    pcm = b"".join([chunk async for chunk in stream.chunks()])
    assert isinstance(stream.outcome, Done), stream.outcome
    assert len(pcm) == pytest.approx(2 * 24000 * WHOLE_HELLO_MS / 1000, abs=2 * 480), len(pcm)


async def test_the_tts_websocket_and_the_speech_endpoint_send_a_whole_text_whole(engine, model_dir):
    """`text.delta` with `flush: true`, and `POST /v1/audio/speech`: one engine command each."""
    client = TestClient(TestServer(create_app(server_config(model_dir), engine=engine)))
    await client.start_server()
    try:
        async with client.ws_connect("/v1/tts/stream") as ws:
            assert (await ws.receive_json())["type"] == "session.created"
            await ws.send_json({"type": "text.delta", "text": "Hello.", "flush": True})
            while True:
                message = await ws.receive(timeout=60)
                if message.type == aiohttp.WSMsgType.TEXT and message.json()["type"] == "speech.done":
                    assert message.json()["audio_ms"] == pytest.approx(WHOLE_HELLO_MS, abs=1), message.json()
                    break
                assert message.type != aiohttp.WSMsgType.TEXT or message.json()["type"] != "error", message
        body = {"model": "tts-1", "input": "Hello.", "voice": None, "response_format": "pcm"}
        async with client.post("/v1/audio/speech", json=body) as resp:
            assert resp.status == 200, await resp.text()
            pcm = await resp.read()
        assert len(pcm) == pytest.approx(2 * 24000 * WHOLE_HELLO_MS / 1000, abs=2 * 480), len(pcm)
    finally:
        await client.close()
