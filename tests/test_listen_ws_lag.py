"""A slow audio-WebSocket reader is closed once it is `[listen] ws_stall_timeout_s` behind, even when the
kernel buffers on both ends would hide it for many seconds: numbered pings measure what it has read."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from listen_helpers import caller_clip
from test_listen_api import QUESTION, server_and_caller

from signaling.audio_ws import CLOSE_STALLED, ReaderLag
from voicertc.webrtc import patch_aioice_loopback


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


def test_reader_lag_is_the_age_of_the_oldest_unanswered_ping():
    lag = ReaderLag()
    first = lag.ping(10.0)
    lag.ping(10.2)
    third = lag.ping(10.4)
    assert lag.behind_s(10.5) == pytest.approx(0.5)
    lag.pong(first)
    assert lag.behind_s(10.5) == pytest.approx(0.3)
    lag.pong(b"junk")  # not one of ours: ignored
    lag.pong(third)  # answers everything before it too
    assert lag.behind_s(11.0) == 0.0


async def test_a_reader_at_a_fifth_of_real_time_is_closed_after_falling_behind():
    pcm, _ = caller_clip([0.2, QUESTION])
    async with server_and_caller(pcm, ws_stall_timeout_s=0.5) as (server, call):
        async with aiohttp.ClientSession() as session:
            ws = await session.ws_connect(f"{server.url}/v1/calls/{call.call_id}/audio")
            assert json.loads((await ws.receive(timeout=10)).data)["type"] == "audio.format"
            frames = 0
            while True:  # one 20 ms frame per 100 ms: 20 % of the rate
                message = await ws.receive(timeout=10)
                if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                    break
                assert message.type == aiohttp.WSMsgType.BINARY
                frames += 1
                await asyncio.sleep(0.1)
            assert ws.close_code == CLOSE_STALLED
            # closed with about 0.5 s of the reader's lag; the socket buffers alone would have held
            # many seconds of audio (a reader that read nothing was closed after 26 s before)
            assert frames < 40, frames
            await ws.close()
