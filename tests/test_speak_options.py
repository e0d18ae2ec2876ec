"""Speak options at every edge (HTTP JSON, NDJSON query, data channel, embedding API) on an engine without
them: instruct -> not_supported, speed != 1 -> speed_not_supported (the reference changes speed only
without streaming), bad types -> 400; all refused before anything is queued."""

from __future__ import annotations

import pytest
from test_api import api, expect_error, open_call

from voicertc.errors import InputError
from voicertc.webrtc import patch_aioice_loopback


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


async def test_http_and_data_channel_refuse_what_the_engine_cannot_do():
    async with api() as client:
        call_id, peer = await open_call(client)
        speak = f"/v1/calls/{call_id}/speak"
        await expect_error(
            await client.post(speak, json={"text": "Hi.", "instruct": "Be happy."}), 400, "not_supported"
        )
        await expect_error(
            await client.post(speak, json={"text": "Hi.", "speed": 1.5}), 400, "speed_not_supported"
        )
        await expect_error(await client.post(speak, json={"text": "Hi.", "speed": "fast"}), 400, "bad_input")
        await expect_error(await client.post(speak, json={"text": "Hi.", "speed": 9}), 400, "bad_input")
        await expect_error(await client.post(speak, json={"text": "Hi.", "instruct": 3}), 400, "bad_input")
        ndjson = {"Content-Type": "application/x-ndjson"}
        resp = await client.post(f"{speak}?speed=1.5", data=b'{"text": "Hi."}\n', headers=ndjson)
        await expect_error(resp, 400, "speed_not_supported")
        resp = await client.post(speak, json={"text": "Fine.", "speed": 1.0, "instruct": ""})
        assert resp.status == 202
        await peer.wait_event("speech.done")
        peer.send({"type": "speak", "text": "Hi.", "instruct": "Whisper."})
        assert (await peer.wait_event("error"))["code"] == "not_supported"


async def test_embedding_say_refuses_too():
    from signaling.embed import AgentCall

    async with api() as client:
        call_id, _peer = await open_call(client)
        from signaling.routes import REGISTRY

        call = AgentCall(client.server.app[REGISTRY].calls[call_id])
        with pytest.raises(InputError, match="instruct is not supported"):
            call.say("Hi.", instruct="Whisper.")
        with pytest.raises(InputError, match="non-streaming"):
            call.say("Hi.", speed=0.8)
