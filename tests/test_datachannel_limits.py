"""Data-channel messages over the answer's `max-message-size` are refused before reassembly grows with
them (issue 24, item 6): `error` `message_too_large`, the channel closed, the call and other calls go
on. Real aiortc peers on the real app (fake engine); the sending peer skips its own size check, as a
hostile client would."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from api_helpers import api, open_call

from signaling.routes import REGISTRY
from voicertc.webrtc import patch_aioice_loopback
from voicertc.webrtc.sctp_limits import SLACK_BYTES


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


async def test_a_message_over_max_message_size_closes_only_that_channel(caplog):
    async with api() as client:
        call_id, peer = await open_call(client)
        other_id, other = await open_call(client)
        answer = peer.pc.remoteDescription.sdp
        assert "a=max-message-size:262144" in answer
        peer.pc.sctp._remote_max_message_size = 0  # a client that ignores the advertised size
        peer.channel.send("x" * (4 * 1024 * 1024))  # 4 MiB: ~3,500 fragments
        error = await peer.wait_event("error", timeout_s=30)
        assert error["code"] == "message_too_large" and "262144" in error["message"]
        for _ in range(100):
            if peer.channel.readyState == "closed":
                break
            await asyncio.sleep(0.1)
        assert peer.channel.readyState == "closed"

        refused = [r for r in caplog.records if "data channel message over" in r.getMessage()]
        assert len(refused) == 1 and refused[0].levelno == logging.WARNING
        held = int(re.search(r"\((\d+) held\)", refused[0].getMessage()).group(1))
        assert held <= 262144 + SLACK_BYTES + 1500  # reassembly stopped one fragment past the bound
        assert call_id in client.app[REGISTRY].calls

        # the call is still up (HTTP speak works, audio flows), and so is the other call's channel
        resp = await client.post(f"/v1/calls/{call_id}/speak", json={"text": "Still here."})
        assert resp.status == 202
        other.send({"type": "speak", "text": "Me too."})
        started = await other.wait_event("speech.started", timeout_s=20)
        assert started["utterance_id"]
        info = await (await client.get(f"/v1/calls/{other_id}")).json()
        assert info["state"] == "connected"


async def test_messages_within_the_limit_still_work():
    async with api() as client:
        _, peer = await open_call(client)
        peer.send({"type": "speak", "text": "word " * 40_000})  # 200 KB: under 262144
        error = await peer.wait_event("error", timeout_s=30)
        assert error["code"] == "text_too_long"  # parsed and answered: it was reassembled and read
