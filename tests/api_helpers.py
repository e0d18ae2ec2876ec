"""The HTTP API under aiohttp's test client with the fake engine, and real aiortc peers calling it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from call_helpers import PeerClient, fake_config

from signaling.app import create_app


@contextlib.asynccontextmanager
async def api(**sections: dict[str, Any]) -> AsyncIterator[TestClient]:
    """A running app on the fake engine (`sections` override config keys); peers opened with
    `open_call` are closed with it."""
    client = TestClient(TestServer(create_app(fake_config(**sections))))
    await client.start_server()
    peers: list[PeerClient] = []
    client.peers = peers  # type: ignore[attr-defined]
    try:
        yield client
    finally:
        for peer in peers:
            await peer.close()
        await client.close()


async def open_call(
    client: TestClient, as_json: bool = False, headers: dict[str, str] | None = None
) -> tuple[str, PeerClient]:
    """A connected call with its data channel open: (call id, the browser side)."""
    peer = PeerClient()
    client.peers.append(peer)  # type: ignore[attr-defined]
    offer = await peer.offer()
    if as_json:
        resp = await client.post("/v1/calls", json={"sdp": offer, "type": "offer"}, headers=headers)
        assert resp.status == 201, await resp.text()
        body = await resp.json()
        assert body["type"] == "answer"
        call_id, answer = body["id"], body["sdp"]
    else:
        sdp = {"Content-Type": "application/sdp", **(headers or {})}
        resp = await client.post("/v1/calls", data=offer, headers=sdp)
        assert resp.status == 201, await resp.text()
        assert resp.content_type == "application/sdp"
        answer = await resp.text()
        call_id = resp.headers["Location"].rsplit("/", 1)[1]
    assert resp.headers["Location"] == f"/v1/calls/{call_id}"
    await peer.accept(answer)
    await peer.wait_open()
    return call_id, peer


async def expect_error(resp: Any, status: int, code: str) -> dict[str, Any]:
    """Assert a JSON error `{"error": {"code", "message"}}` with this status and code."""
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert body["error"]["code"] == code, body
    assert body["error"]["message"]
    return body
