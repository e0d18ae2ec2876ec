"""`[webrtc] dtx` on a real call (aiortc peer on loopback, real Opus): the answer asks the caller's
mic for `usedtx=1`; a silent agent sends a DTX packet per 400 ms, then speaks on time with no
underrun or gap; with `dtx = false` the answer and the stream are as before."""

from __future__ import annotations

import asyncio

import pytest
from call_helpers import rms
from test_call import call_pair, loopback_ice  # noqa: F401  (the fixture)


def opus_fmtp(sdp: str) -> str:
    audio = sdp.split("m=audio", 1)[1].split("m=", 1)[0].split("\r\n")
    opus = next(line.split()[0][len("a=rtpmap:") :] for line in audio if "opus/48000" in line)
    return next((line for line in audio if line.startswith(f"a=fmtp:{opus} ")), "")


async def frames_per_s(client, seconds: float = 1.0) -> float:
    before = len(client.pcm)
    await asyncio.sleep(seconds)
    return (len(client.pcm) - before) / seconds


async def test_a_silent_agent_sends_dtx_and_speaks_on_time():
    async with call_pair(mic=True, listen={"transcribe": False}) as (call, client, _engine):
        assert "usedtx=1" in opus_fmtp(client.pc.remoteDescription.sdp)
        await asyncio.sleep(0.5)  # past the 200 ms hangover
        assert await frames_per_s(client) <= 5  # 2.5 DTX packets a second, not 50 frames
        handle = call.speak("Heard after a silence.")
        started = await client.wait_event("speech.started", utterance_id=handle.utterance_id)
        done = await handle.done()
        assert done["type"] == "speech.done"
        assert started["ttfa_ms"] > 0
        await asyncio.sleep(0.3)
        assert rms(client.audio()) > 0.05
        stats = call.track.stats
        assert stats.dtx_frames > 20 and stats.gaps_over_100ms == 0 and stats.underrun_frames == 0
        assert call.counters()["dtx_frames"] == stats.dtx_frames  # /metrics: voicertc_dtx_frames_total


@pytest.mark.parametrize("mic", [True, False])
async def test_with_dtx_off_the_answer_and_the_stream_are_as_before(mic):
    async with call_pair(mic=mic, webrtc={"dtx": False}, listen={"transcribe": False}) as (call, client, _e):
        assert "usedtx" not in opus_fmtp(client.pc.remoteDescription.sdp)
        await asyncio.sleep(0.5)
        assert await frames_per_s(client) >= 40
        assert call.track.stats.dtx_frames == 0


async def test_a_recvonly_caller_is_not_asked_for_dtx():
    async with call_pair(mic=False) as (call, client, _engine):
        assert "usedtx" not in opus_fmtp(client.pc.remoteDescription.sdp)
        await asyncio.sleep(0.5)
        assert await frames_per_s(client) <= 5  # the agent's own silence is still DTX
