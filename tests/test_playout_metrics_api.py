"""`late_frames` and `gaps_over_100ms` beside `underrun_frames` in GET /v1/calls/{id} and /metrics, as the
track counts them on a real aiortc call (fake engine), including a stall of the event loop."""

from __future__ import annotations

import asyncio
import time

import pytest
from api_helpers import api, open_call

from voicertc.webrtc import patch_aioice_loopback


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


def metric(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


async def test_a_stalled_event_loop_shows_in_the_call_and_in_metrics():
    async with api() as client:
        call_id, peer = await open_call(client)
        resp = await client.post(f"/v1/calls/{call_id}/speak", json={"text": "A long sentence to play. " * 8})
        assert resp.status == 202
        await peer.wait_event("speech.started", timeout_s=10)
        await asyncio.sleep(0.3)
        time.sleep(0.5)  # noqa: ASYNC251 - on purpose: the event loop stalls 500 ms mid-utterance
        await asyncio.sleep(0.3)
        info = await (await client.get(f"/v1/calls/{call_id}")).json()
        assert info["underrun_frames"] >= 15, info  # ~24 frames due in the stall were never sent
        assert info["late_frames"] >= 1 and info["gaps_over_100ms"] >= 1, info
        text = await (await client.get("/metrics")).text()
        assert metric(text, "voicertc_late_frames_total") >= 1
        assert metric(text, "voicertc_gaps_over_100ms_total") >= 1
        assert metric(text, "voicertc_underrun_frames_total") >= 15
