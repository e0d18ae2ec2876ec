"""Offers that never connect cannot lock out real clients: a short ICE/DTLS deadline for pending calls
and a per-token cap on them, apart from `max_calls` (issue 11, finding 5)."""

from __future__ import annotations

import asyncio

import pytest
from api_helpers import api, expect_error, open_call
from call_helpers import PeerClient

from signaling.auth import token_digest
from signaling.routes import REGISTRY
from voicertc.config import config_from_dict
from voicertc.errors import ConfigError
from voicertc.webrtc import patch_aioice_loopback

A, B = "token-a", "token-b"
SDP = {"Content-Type": "application/sdp"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


async def dead_offer(client, token: str | None = None):
    """POST an offer whose client never takes the answer (it never connects)."""
    peer = PeerClient()
    client.peers.append(peer)
    headers = {**SDP, **(bearer(token) if token else {})}
    return await client.post("/v1/calls", data=await peer.offer(), headers=headers)


async def test_a_call_that_never_connects_is_closed_after_pending_timeout():
    async with api(webrtc={"pending_timeout_s": 1.0, "connect_timeout_s": 60.0}) as client:
        resp = await dead_offer(client)
        assert resp.status == 201
        call_id = resp.headers["Location"].rsplit("/", 1)[1]
        call = client.app[REGISTRY].calls[call_id]
        await asyncio.wait_for(call.closed.wait(), 20)
        assert call.close_reason == "pending timeout"
        await expect_error(await client.get(f"/v1/calls/{call_id}"), 404, "unknown_call")


async def test_pending_calls_are_capped_per_token_and_cannot_fill_max_calls():
    limits = {"max_calls": 3, "max_pending_calls": 2}
    webrtc = {"pending_timeout_s": 2.0}
    async with api(limits=limits, webrtc=webrtc, auth={"tokens": [A, B]}) as client:
        assert (await dead_offer(client, A)).status == 201
        assert (await dead_offer(client, A)).status == 201
        refused = await dead_offer(client, A)
        await expect_error(refused, 429, "too_many_pending_calls")
        assert int(refused.headers["Retry-After"]) >= 2
        # the third slot of max_calls stays free for someone else
        call_id, peer = await open_call(client, headers=bearer(B))
        resp = await client.post(f"/v1/calls/{call_id}/speak", json={"text": "Hello."}, headers=bearer(B))
        await peer.wait_event("speech.done", utterance_id=(await resp.json())["utterance_id"])
        # once the dead offers time out, A gets its slots back
        registry = client.app[REGISTRY]
        for _ in range(200):
            if registry.pending_calls(token_digest(A)) == 0:
                break
            await asyncio.sleep(0.1)
        await open_call(client, headers=bearer(A))


async def test_without_auth_the_cap_is_per_client_address():
    async with api(limits={"max_pending_calls": 1}) as client:
        assert (await dead_offer(client)).status == 201
        await expect_error(await dead_offer(client), 429, "too_many_pending_calls")


async def test_connected_calls_do_not_count_as_pending():
    async with api(limits={"max_pending_calls": 1}) as client:
        await open_call(client)
        await open_call(client)  # the first is connected: it no longer counts
        assert (await dead_offer(client)).status == 201


@pytest.mark.parametrize(
    ("section", "values", "key"),
    [
        ("webrtc", {"pending_timeout_s": 0}, "webrtc.pending_timeout_s"),
        ("webrtc", {"pending_timeout_s": "1"}, "webrtc.pending_timeout_s"),
        ("limits", {"max_pending_calls": 0}, "limits.max_pending_calls"),
    ],
)
def test_pending_config_errors_name_the_key(section, values, key):
    with pytest.raises(ConfigError, match=key):
        config_from_dict({section: values})
