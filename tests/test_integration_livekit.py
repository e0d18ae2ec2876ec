"""The LiveKit Agents TTS plugin (`voicertc.integrations.livekit.TTS`) standalone, outside a LiveKit job
and without a LiveKit server: `synthesize()` and `stream()` against the server on loopback (fake engine)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from api_helpers import api

pytest.importorskip("livekit.agents")

from livekit.agents import APIError, tts  # noqa: E402

from signaling.app import ENGINE  # noqa: E402
from voicertc.engine.fake import MS_PER_CHAR  # noqa: E402
from voicertc.integrations.livekit import TTS  # noqa: E402

TEXT = "Hello from the LiveKit plugin."
TOKENS = ["Sure", ", I can ", "help ", "with that."]


def seconds(events: list[tts.SynthesizedAudio]) -> float:
    return sum(e.frame.samples_per_channel for e in events) / events[0].frame.sample_rate


async def wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout_s} s")


async def test_synthesize_gives_frames_at_the_rate_with_a_final_one():
    async with api() as client:
        plugin = TTS(url=str(client.make_url("/")), sample_rate=16_000)
        assert plugin.capabilities.streaming and plugin.sample_rate == 16_000
        events = [event async for event in plugin.synthesize(TEXT)]
        await plugin.aclose()
        assert client.app[ENGINE].stats["done"] == 1
    assert events and all(isinstance(e, tts.SynthesizedAudio) for e in events)
    assert {(e.frame.sample_rate, e.frame.num_channels) for e in events} == {(16_000, 1)}
    assert [e.is_final for e in events].count(True) == 1 and events[-1].is_final
    assert abs(seconds(events) - MS_PER_CHAR * len(TEXT) / 1000) < 0.1


async def test_stream_takes_pushed_text_and_ends_its_segment():
    async with api() as client:
        plugin = TTS(url=str(client.make_url("/")))
        stream = plugin.stream()
        for token in TOKENS:
            stream.push_text(token)
        stream.flush()
        stream.end_input()
        events = [event async for event in stream]
        await stream.aclose()
        await plugin.aclose()
        engine = client.app[ENGINE]
        assert engine.stats["done"] == 1 and engine.open_count == 0  # the tokens were one utterance
    assert {e.frame.sample_rate for e in events} == {24_000}
    assert events[-1].is_final and len({e.segment_id for e in events}) == 1
    assert abs(seconds(events) - MS_PER_CHAR * len("".join(TOKENS)) / 1000) < 0.1


async def test_aclose_cancels_the_utterance_on_the_server():
    async with api(fake={"ttfa_ms": 20, "rtf": 1.0, "chunk_ms": 100}) as client:
        engine = client.app[ENGINE]
        plugin = TTS(url=str(client.make_url("/")))
        stream = plugin.stream()
        stream.push_text("A long reply that nobody will hear to the end. " * 4)
        stream.end_input()
        first = await anext(aiter(stream))
        assert first.frame.samples_per_channel > 0 and engine.open_count == 1
        await stream.aclose()
        # it would run ~10 s more; the worker counts the cancel when it applies it (open_count drops first)
        await wait_until(lambda: engine.open_count == 0 and engine.stats["cancelled"] == 1, 2.0)
        await plugin.aclose()


async def test_a_refused_voice_is_an_api_error():
    async with api() as client:
        plugin = TTS(url=str(client.make_url("/")), voice="nobody")
        with pytest.raises(APIError) as caught:
            async for _event in plugin.synthesize(TEXT):
                pass
        assert "unknown_voice" in str(caught.value)
        await plugin.aclose()
