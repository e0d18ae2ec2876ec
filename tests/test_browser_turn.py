"""Headless Chromium calling through a real coturn relay, with the page's relay-only option.

The server (`voicertc serve`, Piper) hands out TURN credentials for a coturn on loopback; the page
fetches them (GET /v1/ice-servers) before its offer and, with `?ice_transport_policy=relay`, gathers
only relay candidates. It must hear the sentence (bundled Whisper, WER <= 0.2) over a selected
candidate pair whose local side is `relay` (getStats). With forged or expired credentials (the
hand-out replaced in flight) coturn refuses the allocation (the page sees icecandidateerror 401),
the call never connects, and the server closes it at `webrtc.pending_timeout_s` (then 404).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest
from browser_helpers import (
    browser_page,
    call,
    event_js,
    hang_up,
    running_server,
    take_capture,
    wait_for,
    write_config,
)
from test_browser import transcribe, word_error_rate

from bench.coturn import Turn, coturn
from voicertc.turn import turn_credentials

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SENTENCE = "Hello, this call goes through a relay. The quick brown fox jumps over the lazy dog."
PENDING_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def turn():
    with coturn() as server:
        yield server


@pytest.fixture(scope="module")
def server_url(turn: Turn):
    config = write_config(
        f"""[server]
port = 0
[webrtc]
loopback_only = true
pending_timeout_s = {PENDING_TIMEOUT_S}
udp_port_min = 47300
udp_port_max = 47339
[engine]
backend = "piper"
[turn]
secret = "{turn.secret}"
urls = ["{turn.url}"]
"""
    )
    with running_server(["--config", str(config)]) as url:
        yield url.rstrip("/")


async def test_chromium_relay_only_call_is_heard(server_url, turn: Turn):
    async with browser_page() as page:
        await call(page, server_url + "/?ice_transport_policy=relay")
        (server,) = await page.evaluate("voicertc.state.iceServers")
        assert server["urls"] == [turn.url] and server["username"] and server["credential"]
        pair = await page.evaluate("voicertc.selectedPair()")
        assert pair is not None and pair["local"] == "relay", pair

        await page.evaluate("voicertc.startCapture()")
        await page.evaluate(f"voicertc.speak({SENTENCE!r})")
        await wait_for(page, event_js("speech.done"), timeout_s=30)
        await asyncio.sleep(0.5)  # the tail in the jitter buffer
        text = transcribe(await take_capture(page))
        wer = word_error_rate(SENTENCE, text)
        assert wer <= 0.2, f"WER {wer:.2f}: heard {text!r}"
        assert (await page.evaluate("voicertc.selectedPair()"))["local"] == "relay"
        await hang_up(page)


@pytest.mark.parametrize("kind", ["forged", "expired"])
async def test_chromium_with_bad_credentials_never_connects(server_url, turn: Turn, kind: str):
    now = int(time.time())
    if kind == "forged":
        username, credential = turn_credentials("guessed-secret", "intruder", now + 600)
    else:
        username, credential = turn_credentials(turn.secret, "late", now - 60)
    servers = [{"urls": [turn.url], "username": username, "credential": credential}]
    body = {"ice_servers": servers, "ice_transport_policy": "relay"}

    async with browser_page() as page:

        async def bad_hand_out(route) -> None:
            await route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

        await page.route("**/v1/ice-servers*", bad_hand_out)  # with or without ?ice_transport_policy
        await page.goto(server_url + "/?ice_transport_policy=relay")
        await page.click("#call")
        await wait_for(page, "voicertc.state.location !== null", timeout_s=15)
        location = server_url + await page.evaluate("voicertc.state.location")
        await wait_for(page, "voicertc.state.iceErrors.some(e => e.errorCode === 401)", timeout_s=10)

        deadline = time.monotonic() + PENDING_TIMEOUT_S + 10
        while await asyncio.to_thread(_status, location) == 200:
            assert time.monotonic() < deadline, "the unconnectable call was not closed"
            await asyncio.sleep(0.25)
        assert await asyncio.to_thread(_status, location) == 404
        assert await page.evaluate("voicertc.connectionState()") != "connected"


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
