"""Utterance limits answer at the request (429), and an NDJSON stream of empty lines times out
(issue 11, findings 6 and 8)."""

from __future__ import annotations

import asyncio
import json

import pytest
from api_helpers import api, expect_error, open_call

from signaling.app import ENGINE
from voicertc.webrtc import patch_aioice_loopback

NDJSON = {"Content-Type": "application/x-ndjson"}
LONG = "This sentence keeps the engine busy for a while. " * 20


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


async def test_a_full_engine_answers_429_and_an_interrupt_frees_its_slot_at_once():
    async with api(limits={"max_utterances": 1}) as client:
        a_id, a_peer = await open_call(client)
        b_id, b_peer = await open_call(client)
        resp = await client.post(f"/v1/calls/{a_id}/speak", json={"text": LONG})
        assert resp.status == 202
        await a_peer.wait_event("speech.started")
        refused = await client.post(f"/v1/calls/{b_id}/speak", json={"text": "Me too."})
        await expect_error(refused, 429, "engine_busy")
        assert refused.headers["Retry-After"]
        b_peer.send({"type": "speak", "text": "Me too."})
        assert (await b_peer.wait_event("error"))["code"] == "engine_busy"
        assert not [e for e in b_peer.events if e["type"] == "speech.queued"]
        assert (await client.post(f"/v1/calls/{a_id}/interrupt")).status == 200
        assert client.app[ENGINE].open_count == 0  # before the worker got to the cancel
        resp = await client.post(f"/v1/calls/{b_id}/speak", json={"text": "Now me."})
        assert resp.status == 202
        await b_peer.wait_event("speech.done", utterance_id=(await resp.json())["utterance_id"])


async def test_a_call_queues_behind_its_own_utterance_at_the_engine_limit():
    async with api(limits={"max_utterances": 1}) as client:
        call_id, peer = await open_call(client)
        url = f"/v1/calls/{call_id}/speak"
        first = await (await client.post(url, json={"text": "First."})).json()
        resp = await client.post(url, json={"text": "Second."})
        assert resp.status == 202  # it opens in the slot the first one frees
        second = await resp.json()
        await peer.wait_event("speech.done", utterance_id=first["utterance_id"])
        await peer.wait_event("speech.done", utterance_id=second["utterance_id"])


@pytest.mark.parametrize("filler", ["", " ", "\n\t"])
async def test_ndjson_lines_without_text_do_not_reset_the_idle_timeout(filler):
    async with api(limits={"text_idle_timeout_s": 0.5}) as client:
        call_id, peer = await open_call(client)

        async def body():
            yield (json.dumps({"text": "Start. "}) + "\n").encode()
            for _ in range(40):  # 2 s of filler: 4x the timeout, unless it resets it
                yield (json.dumps({"text": filler}) + "\n").encode()
                await asyncio.sleep(0.05)

        resp = await client.post(f"/v1/calls/{call_id}/speak", data=body(), headers=NDJSON)
        await expect_error(resp, 408, "text_idle_timeout")
        assert (await peer.wait_event("error"))["code"] == "text_idle_timeout"


async def test_ndjson_text_keeps_a_slow_stream_alive():
    async with api(limits={"text_idle_timeout_s": 0.5}) as client:
        call_id, peer = await open_call(client)

        async def body():
            for word in ["One ", "two ", "three ", "four ", "five."]:
                yield (json.dumps({"text": ""}) + "\n").encode()
                await asyncio.sleep(0.2)
                yield (json.dumps({"text": word}) + "\n").encode()

        resp = await client.post(f"/v1/calls/{call_id}/speak", data=body(), headers=NDJSON)
        assert resp.status == 202, await resp.text()
        await peer.wait_event("speech.done", utterance_id=(await resp.json())["utterance_id"])
