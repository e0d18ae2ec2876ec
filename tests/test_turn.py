"""TURN: per-call credentials in coturn's REST API scheme, the ICE-server hand-out (JSON and WHIP `Link`
headers), and real calls relayed by a real coturn on loopback (aiortc caller with a relay-only
policy); forged and expired credentials refused by coturn; the server's UDP port range."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import re
import socket
import time

import pytest
from aiortc import RTCIceServer
from api_helpers import api, expect_error
from call_helpers import PeerClient, rms

from bench.coturn import Turn, coturn
from voicertc.config import config_from_dict
from voicertc.errors import ConfigError
from voicertc.turn import IceServer, ice_servers_for, turn_credentials
from voicertc.webrtc.ports import bind_in_range, pick_ports

PORT_RANGE = (47100, 47139)
LINK = re.compile(
    r'^<(?P<url>[^>]+)>; rel="ice-server"; username="(?P<username>[^"]+)"; '
    r'credential="(?P<credential>[^"]+)"; credential-type="password"$'
)


def _hmac_b64(secret: str, username: str) -> str:
    return base64.b64encode(hmac.new(secret.encode(), username.encode(), hashlib.sha1).digest()).decode()


# --- credentials and the hand-out, without a relay ---------------------------------------------------


def test_credentials_follow_the_turn_rest_api():
    username, credential = turn_credentials("s3cret", "call42", 1_800_000_000)
    assert username == "1800000000:call42"
    assert credential == _hmac_b64("s3cret", username)
    assert "s3cret" not in username + credential
    assert turn_credentials("other", "call42", 1_800_000_000)[1] != credential


def test_hand_out_lists_stun_as_is_and_turn_with_expiring_credentials():
    config = config_from_dict(
        {
            "webrtc": {"ice_servers": ["stun:stun.example.net:3478"]},
            "turn": {"secret": "k", "urls": ["turn:turn.example.net?transport=udp", "turns:t.example.net"]},
        }
    )
    stun, turn = ice_servers_for(config, "abc", now_s=1000.0)
    assert stun == IceServer(urls=("stun:stun.example.net:3478",))
    assert stun.as_json() == {"urls": ["stun:stun.example.net:3478"]}
    assert turn.username == f"{1000 + config.turn.ttl_s}:abc"
    assert turn.credential == _hmac_b64("k", turn.username)
    links = turn.link_headers()
    assert [LINK.match(v).group("url") for v in links] == list(turn.urls)  # type: ignore[union-attr]
    assert stun.link_headers() == ['<stun:stun.example.net:3478>; rel="ice-server"']


@pytest.mark.parametrize(
    ("section", "values", "key"),
    [
        ("turn", {"urls": ["turn:x"]}, "turn.secret"),
        ("turn", {"secret": "k"}, "turn.urls"),
        ("turn", {"secret": "k", "urls": ["stun:x"]}, "turn.urls"),
        ("turn", {"secret": "k", "urls": ["turn:x"], "ttl_s": 5}, "turn.ttl_s"),
        ("webrtc", {"ice_servers": ["http://x"]}, "webrtc.ice_servers"),
        ("webrtc", {"udp_port_min": 50000}, "webrtc.udp_port_max"),
        ("webrtc", {"udp_port_min": 80, "udp_port_max": 90}, "webrtc.udp_port_min"),
        ("webrtc", {"udp_port_min": 50010, "udp_port_max": 50000}, "webrtc.udp_port_max"),
    ],
)
def test_config_errors_name_the_key(section, values, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        config_from_dict({section: values})


async def test_ice_servers_endpoint_options_and_link_headers():
    turn = {"secret": "k", "urls": ["turn:127.0.0.1:3478?transport=udp"]}
    async with api(turn=turn, auth={"tokens": ["tok"]}) as client:
        auth = {"Authorization": "Bearer tok"}
        await expect_error(await client.get("/v1/ice-servers"), 401, "unauthorized")
        await expect_error(await client.options("/v1/calls"), 401, "unauthorized")

        first = await (await client.get("/v1/ice-servers", headers=auth)).json()
        second = await (await client.get("/v1/ice-servers", headers=auth)).json()
        (server,) = first["ice_servers"]
        assert set(server) == {"urls", "username", "credential"}
        assert server["urls"] == turn["urls"]
        expiry, _, user = server["username"].partition(":")
        assert 0 < int(expiry) - time.time() <= 3600 + 5
        assert server["credential"] == _hmac_b64("k", server["username"])
        assert second["ice_servers"][0]["username"] != server["username"]  # fresh per request

        options = await client.options("/v1/calls", headers=auth)
        assert options.status == 204
        (link,) = options.headers.getall("Link")
        match = LINK.match(link)
        assert match and match.group("url") == turn["urls"][0]
        assert match.group("credential") == _hmac_b64("k", match.group("username"))

        peer = PeerClient()
        client.peers.append(peer)  # type: ignore[attr-defined]
        resp = await client.post(
            "/v1/calls", data=await peer.offer(), headers={"Content-Type": "application/sdp", **auth}
        )
        assert resp.status == 201
        call_id = resp.headers["Location"].rsplit("/", 1)[1]
        (link,) = resp.headers.getall("Link")
        match = LINK.match(link)
        assert match and match.group("username").endswith(f":{call_id}")  # named after the call
        assert match.group("credential") == _hmac_b64("k", match.group("username"))


async def test_no_turn_configured_hands_out_nothing():
    async with api() as client:
        assert await (await client.get("/v1/ice-servers")).json() == {"ice_servers": []}
        relay = await client.get("/v1/ice-servers?ice_transport_policy=relay")
        assert await relay.json() == {"ice_servers": [], "ice_transport_policy": "relay"}
        await expect_error(await client.get("/v1/ice-servers?ice_transport_policy=x"), 400, "bad_request")
        options = await client.options("/v1/calls")
        assert options.status == 204 and "Link" not in options.headers


# --- the server's UDP port range ------------------------------------------------------------------


def test_pick_ports_covers_the_range_once_from_the_start():
    assert pick_ports(5000, 5004, 5003) == [5003, 5004, 5000, 5001, 5002]
    assert sorted(pick_ports(5000, 5004, 5000)) == list(range(5000, 5005))


async def test_bind_in_range_skips_taken_ports_and_fails_when_full():
    low = _free_udp_range(3)
    taken = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    try:
        taken[0].bind(("127.0.0.1", low))
        taken[1].bind(("127.0.0.1", low + 2))
        loop = asyncio.get_running_loop()
        transport, _ = await bind_in_range(loop, asyncio.DatagramProtocol, "127.0.0.1", low, low + 2)
        assert transport.get_extra_info("sockname")[1] == low + 1
        with pytest.raises(OSError, match="no free UDP port"):
            await bind_in_range(loop, asyncio.DatagramProtocol, "127.0.0.1", low, low + 2)
        transport.close()
    finally:
        for sock in taken:
            sock.close()


def _free_udp_range(span: int) -> int:
    for low in range(47200, 48000, span):
        socks = []
        try:
            for port in range(low, low + span):
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return low
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free UDP range")


# --- a real coturn -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def turn():
    with coturn() as server:
        yield server


def _candidates(sdp: str) -> list[tuple[str, int, str]]:
    """(address, port, type) of every a=candidate line."""
    found = []
    for line in sdp.splitlines():
        if line.startswith("a=candidate:"):
            fields = line.split()
            found.append((fields[4], int(fields[5]), fields[7]))
    return found


def _relay_peer(server: dict) -> PeerClient:
    ice = RTCIceServer(urls=server["urls"], username=server["username"], credential=server["credential"])
    return PeerClient(ice_servers=[ice], relay_only=True)


async def test_relay_only_aiortc_call_through_coturn(turn: Turn):
    """The handed-out credentials allocate on coturn; the caller offers only its relay candidate, the
    server answers from its port range, media and events flow through the relay."""
    webrtc = {"udp_port_min": PORT_RANGE[0], "udp_port_max": PORT_RANGE[1]}
    async with api(turn={"secret": turn.secret, "urls": [turn.url]}, webrtc=webrtc) as client:
        (server,) = (await (await client.get("/v1/ice-servers")).json())["ice_servers"]
        peer = _relay_peer(server)
        client.peers.append(peer)  # type: ignore[attr-defined]
        offer = await peer.offer()
        offered = _candidates(offer)
        assert offered and all(kind == "relay" for _, _, kind in offered), offered
        low, high = turn.relay_ports
        assert all(low <= port <= high for _, port, _ in offered)  # allocated on our coturn

        resp = await client.post("/v1/calls", data=offer, headers={"Content-Type": "application/sdp"})
        assert resp.status == 201, await resp.text()
        answer = await resp.text()
        answered = _candidates(answer)
        assert answered and all(PORT_RANGE[0] <= port <= PORT_RANGE[1] for _, port, _ in answered), answered
        await peer.accept(answer)
        await peer.wait_open(15)
        call_id = resp.headers["Location"].rsplit("/", 1)[1]

        (pair,) = peer.pc.getTransceivers()[0].receiver.transport.transport._connection._nominated.values()
        assert pair.local_candidate.type == "relay"
        assert PORT_RANGE[0] <= pair.remote_candidate.port <= PORT_RANGE[1]

        spoken = await client.post(f"/v1/calls/{call_id}/speak", json={"text": "Relayed through TURN."})
        assert spoken.status == 202
        await peer.wait_event("speech.done", timeout_s=15)
        assert rms(peer.audio()) > 0.05  # the fake engine's tone arrived through the relay


@pytest.mark.parametrize("kind", ["forged", "expired"])
async def test_coturn_refuses_forged_and_expired_credentials(turn: Turn, kind: str):
    """coturn itself answers 401 to an allocation with a forged password or a past expiry (the valid
    credential of the same server allocates); a relay-only caller with such credentials gathers no
    candidate, never connects, and the server closes the call at `webrtc.pending_timeout_s`."""
    from aioice.stun import TransactionFailed
    from aioice.turn import create_turn_endpoint

    now = int(time.time())
    username, credential = turn_credentials(turn.secret, "caller", now + 600)
    transport, _ = await create_turn_endpoint(
        asyncio.DatagramProtocol, ("127.0.0.1", turn.port), username, credential
    )
    transport.close()
    if kind == "forged":
        username, credential = turn_credentials("not-the-secret", "caller", now + 600)
    else:
        username, credential = turn_credentials(turn.secret, "caller", now - 60)
    with pytest.raises(TransactionFailed, match="401"):
        await create_turn_endpoint(asyncio.DatagramProtocol, ("127.0.0.1", turn.port), username, credential)

    webrtc = {"pending_timeout_s": 2.0}
    async with api(turn={"secret": turn.secret, "urls": [turn.url]}, webrtc=webrtc) as client:
        peer = _relay_peer({"urls": [turn.url], "username": username, "credential": credential})
        client.peers.append(peer)  # type: ignore[attr-defined]
        offer = await peer.offer()
        assert _candidates(offer) == []
        resp = await client.post("/v1/calls", data=offer, headers={"Content-Type": "application/sdp"})
        assert resp.status == 201  # the server cannot know; ICE decides
        location = resp.headers["Location"]
        deadline = asyncio.get_running_loop().time() + 10
        while (await client.get(location)).status == 200:
            assert asyncio.get_running_loop().time() < deadline, "the unconnectable call was not closed"
            await asyncio.sleep(0.25)
        await expect_error(await client.get(location), 404, "unknown_call")
        assert peer.pc.connectionState != "connected"
