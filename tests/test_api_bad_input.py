"""Every bad input is a 4xx JSON error before anything is queued (issue 11, findings 3, 5, 9, 10)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from api_helpers import api, expect_error, open_call
from call_helpers import PeerClient, fake_config

from signaling.embed import VoiceServer
from voicertc.validate import BadTextError
from voicertc.webrtc import patch_aioice_loopback

SDP = {"Content-Type": "application/sdp"}
NDJSON = {"Content-Type": "application/x-ndjson"}
FRAG = {"Content-Type": "application/trickle-ice-sdpfrag"}
DEEP = b"[" * 4096 + b"]" * 4096
BAD_TEXTS = ["NUL \x00 inside", "lone \ud800 surrogate", "bell \x07", "nonchar \ufffe", "c1 \x9b"]


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


def _replace_lines(sdp: str, prefix: str, new: str | None) -> str:
    lines = sdp.split("\r\n")
    return "\r\n".join(
        new if line.startswith(prefix) else line for line in lines if new or not line.startswith(prefix)
    )


async def _offer() -> str:
    peer = PeerClient()
    try:
        return await peer.offer()
    finally:
        await peer.close()


async def test_undecodable_and_deeply_nested_bodies_are_400():
    """Finding 3: non-UTF-8 SDP/PATCH bodies and deep JSON were 500s with tracebacks."""
    async with api() as client:
        latin1 = (await _offer()).replace("v=0", "v=0\r\ns=caf\xe9", 1).encode("latin-1")
        await expect_error(await client.post("/v1/calls", data=latin1, headers=SDP), 400, "bad_encoding")
        json_type = {"Content-Type": "application/json"}
        await expect_error(await client.post("/v1/calls", data=DEEP, headers=json_type), 400, "bad_json")
        await expect_error(await client.post("/v1/calls", data=b"\xff{", headers=json_type), 400, "bad_json")
        call_id, _peer = await open_call(client)
        patch = await client.patch(f"/v1/calls/{call_id}", data=b"a=candidate:\xff\xfe", headers=FRAG)
        await expect_error(patch, 400, "bad_encoding")
        speak = f"/v1/calls/{call_id}/speak"
        await expect_error(await client.post(speak, data=DEEP, headers=json_type), 400, "bad_json")
        nested = b'{"text": "hi", "x": ' + DEEP + b"}"
        await expect_error(await client.post(speak, data=nested, headers=json_type), 400, "bad_json")
        await expect_error(await client.post(speak, data=DEEP + b"\n", headers=NDJSON), 400, "bad_ndjson")
        info = await (await client.get(f"/v1/calls/{call_id}")).json()
        assert info["pending_utterances"] == 0


@pytest.mark.parametrize("text", BAD_TEXTS)
async def test_unspeakable_text_is_refused_at_every_edge(text):
    """Finding 9: NUL characters and lone surrogates got 202, then a synthesis error and a traceback."""
    async with api() as client:
        call_id, peer = await open_call(client)
        speak = f"/v1/calls/{call_id}/speak"
        await expect_error(await client.post(speak, json={"text": text}), 400, "bad_text")
        line = json.dumps({"text": text}).encode() + b"\n"
        await expect_error(await client.post(speak, data=line, headers=NDJSON), 400, "bad_text")
        peer.send({"type": "speak", "text": text})
        assert (await peer.wait_event("error"))["code"] == "bad_text"
        queued = [e for e in peer.events if e["type"] == "speech.queued"]
        assert len(queued) == 1  # only the NDJSON stream's (its id goes out before its lines arrive)
        resp = await client.post(speak, json={"text": "Still fine."})
        assert resp.status == 202
        await peer.wait_event("speech.done", utterance_id=(await resp.json())["utterance_id"])


async def test_embedded_say_refuses_unspeakable_text():
    async with VoiceServer(fake_config(server={"port": 0})) as server:
        peer = PeerClient()
        try:
            async with aiohttp.ClientSession() as http:
                resp = await http.post(f"{server.url}/v1/calls", data=await peer.offer(), headers=SDP)
                await peer.accept(await resp.text())
            call = await server.next_call(timeout_s=10)
            with pytest.raises(BadTextError):
                call.say("a \x00 b")

            async def deltas():
                yield "fine "
                yield "then \ud800"

            event = await call.say(deltas()).done()
            assert event["type"] == "error" and event["code"] == "bad_text"
        finally:
            await peer.close()


async def test_offers_without_a_usable_fingerprint_or_with_bad_m_lines_are_400():
    """Finding 5: these got 201, then an unhandled aiortc AssertionError in its connect task."""
    offer = await _offer()
    broken = {
        "no fingerprint": _replace_lines(offer, "a=fingerprint", None),
        "bad hash": _replace_lines(offer, "a=fingerprint", "a=fingerprint:sha-256 ZZ"),
        "short hash": _replace_lines(offer, "a=fingerprint", "a=fingerprint:sha-256 AB:CD"),
        "unknown hash only": _replace_lines(offer, "a=fingerprint", "a=fingerprint:md5 AB:CD"),
        "m=audio abc": _replace_lines(offer, "m=audio", "m=audio abc"),
        "port not a number": _replace_lines(offer, "m=audio", "m=audio x UDP/TLS/RTP/SAVPF 111"),
        "payload type": _replace_lines(offer, "m=audio", "m=audio 9 UDP/TLS/RTP/SAVPF opus"),
        "NUL": offer.replace("a=mid:0", "a=mid:\x000"),
        "not a line": offer.replace("a=mid:0", "mid 0"),
        "no ice pwd": _replace_lines(offer, "a=ice-pwd", None),
    }
    async with api() as client:
        for name, sdp in broken.items():
            resp = await client.post("/v1/calls", data=sdp.encode(), headers=SDP)
            assert resp.status == 400, (name, await resp.text())
            assert (await resp.json())["error"]["code"] == "bad_sdp", name
        health = await (await client.get("/healthz")).json()
        assert health["status"] == "ok"
        assert "active_calls" not in health or health["active_calls"] == 0
        await asyncio.sleep(0.2)  # any connect task aiortc started would fail here (the guard sees it)


async def test_http_hygiene():
    """Finding 10: 405 with Allow, strict query booleans, NUL in a header without a traceback."""
    async with api() as client:
        resp = await client.put("/v1/calls")
        await expect_error(resp, 405, "method_not_allowed")
        assert set(resp.headers["Allow"].split(",")) == {"POST", "OPTIONS"}  # OPTIONS: WHIP's ICE servers
        resp = await client.put("/v1/calls/abc")
        await expect_error(resp, 405, "method_not_allowed")
        assert set(resp.headers["Allow"].split(",")) >= {"GET", "PATCH", "DELETE"}
        call_id, _peer = await open_call(client)
        url = f"/v1/calls/{call_id}/speak"
        for value in ("null", "yes", ""):
            resp = await client.post(f"{url}?interrupt={value}", data=b'{"text": "x"}\n', headers=NDJSON)
            await expect_error(resp, 400, "bad_request")
        host, port = client.server.host, client.server.port
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n")
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert b" 400 " in status_line
