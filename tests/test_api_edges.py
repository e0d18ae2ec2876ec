"""Edges enforce what they advertise (issue 24, item 6): a deadline on request bodies (a lying
Content-Length, a slowloris), clients that leave mid-body (499 at INFO, no traceback, not counted),
and a cap on pending calls across client addresses. Real sockets against the real app (fake engine)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
import pytest
from aiohttp import web
from api_helpers import api, expect_error
from call_helpers import PeerClient, fake_config

from signaling.app import METRICS, create_app
from voicertc.webrtc import patch_aioice_loopback

SDP = {"Content-Type": "application/sdp"}


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


class Served:
    """The app as `voicertc serve` runs it (an AppRunner: a client that leaves does not cancel the
    handler, unlike aiohttp's TestServer), with a session to call it."""

    def __init__(self, app: web.Application, port: int, session: aiohttp.ClientSession) -> None:
        self.app, self.port, self.session = app, port, session

    def post(self, path: str, **kwargs):
        return self.session.post(f"http://127.0.0.1:{self.port}{path}", **kwargs)


@contextlib.asynccontextmanager
async def served(**sections):
    app = create_app(fake_config(**sections))
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    async with aiohttp.ClientSession() as session:
        try:
            yield Served(app, port, session)
        finally:
            await runner.cleanup()


async def raw_request(client, head: str, body_parts: list[bytes], gap_s: float = 0.0, close: bool = False):
    """Send a request by hand: (status line, reader, writer). `close` hangs up after the parts."""
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(head.encode() + b"\r\n")

    async def send() -> None:
        with contextlib.suppress(ConnectionResetError):  # the server may close first (a 408)
            for part in body_parts:
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(gap_s)

    if close:
        await send()
        writer.close()
        return None, None, None
    sending = asyncio.ensure_future(send())
    line = await asyncio.wait_for(reader.readline(), 20)
    sending.cancel()
    return line.decode(), reader, writer


def head(method: str, path: str, content_type: str, length: int | None) -> str:
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost", f"Content-Type: {content_type}"]
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    return "\r\n".join(lines) + "\r\n"


async def test_a_lying_content_length_and_a_slowloris_get_408_within_the_deadline():
    async with served(server={"body_timeout_s": 0.5}) as client:
        status, _, writer = await raw_request(
            client, head("POST", "/v1/calls", "application/sdp", 5000), [b"v=0\r\n"]
        )
        assert status.startswith("HTTP/1.1 408"), status
        writer.close()
        # a byte every 0.2 s keeps the connection busy but never finishes: the deadline is on the whole body
        slow = [b"{"] + [b" "] * 50
        sent = asyncio.ensure_future(
            raw_request(client, head("POST", "/v1/voices", "application/json", 1000), slow, gap_s=0.2)
        )
        status, reader, writer = await sent
        assert status.startswith("HTTP/1.1 408"), status
        rest = await asyncio.wait_for(reader.read(), 5)  # the server closed the connection after it
        assert b'"body_timeout"' in rest and b"server.body_timeout_s" in rest
        writer.close()
        assert client.app[METRICS].http_errors_total.get(408) == 2
        # a body that arrives in time is served as before
        async with client.post("/v1/calls", data="not sdp", headers=SDP) as resp:
            await expect_error(resp, 400, "bad_sdp")


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/v1/calls", "application/sdp"),
        ("/v1/voices", "multipart/form-data; boundary=xyz"),
        ("/v1/voices", "application/json"),
        ("/v1/calls/{call}/speak", "application/x-ndjson"),
    ],
)
async def test_a_client_leaving_mid_body_is_one_info_line_not_an_error(path, content_type, caplog):
    caplog.set_level(logging.INFO)
    peer = PeerClient()
    async with served(server={"body_timeout_s": 30.0}) as client:
        try:
            if "{call}" in path:  # NDJSON speech into a real call
                async with client.post("/v1/calls", data=await peer.offer(), headers=SDP) as resp:
                    assert resp.status == 201
                    await peer.accept(await resp.text())
                await peer.wait_open()
                path = path.format(call=resp.headers["Location"].rsplit("/", 1)[1])
                parts = [b'{"text": "Hello "}\n']
            else:
                parts = [b"--xyz\r\n" if "multipart" in content_type else b"v=0\r\n"]
            await raw_request(client, head("POST", path, content_type, 100_000), parts, gap_s=0.2, close=True)
            for _ in range(100):
                if any("disconnected mid-request" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.05)
        finally:
            await peer.close()
        lines = [r for r in caplog.records if "disconnected mid-request" in r.getMessage()]
        assert lines and lines[0].levelno == logging.INFO, [r.getMessage() for r in caplog.records]
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        counted = client.app[METRICS].http_errors_total
        assert 500 not in counted and 499 not in counted, counted


async def test_pending_calls_are_capped_across_client_addresses():
    limits = {"max_calls": 8, "max_pending_calls": 4, "max_pending_total": 2}
    async with api(limits=limits, webrtc={"pending_timeout_s": 30.0}) as client:
        for _ in range(2):  # within this address's own cap (max_pending_calls = 4)
            peer = PeerClient()
            client.peers.append(peer)
            resp = await client.post("/v1/calls", data=await peer.offer(), headers=SDP)
            assert resp.status == 201, await resp.text()
        peer = PeerClient()
        client.peers.append(peer)
        refused = await client.post("/v1/calls", data=await peer.offer(), headers=SDP)
        body = await expect_error(refused, 429, "too_many_pending_calls")
        assert "limits.max_pending_total" in body["error"]["message"]
        assert int(refused.headers["Retry-After"]) >= 1
