"""Graceful drain: SIGTERM to `voicertc serve` while two calls speak. New calls get 503 `draining`,
/readyz 503; each call hears its utterance to the end, then `call.closing {reason: "server_draining"}`;
the process exits 0. In-process: the drain timeout cuts a long utterance, and utterances queued behind
the current one are not started."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading

import aiohttp
from api_helpers import api, expect_error, open_call
from browser_helpers import REPO, write_config
from call_helpers import PeerClient

from bench.peer import HttpPeer
from signaling.drain import DRAIN
from voicertc.webrtc.loopback import patch_aioice_loopback

TEXT = "A sentence that takes a few seconds to say."  # fake engine: 65 ms per character
DRAIN_TIMEOUT_S = 20.0


def _start_server(config_toml: str) -> tuple[subprocess.Popen[str], str, list[str]]:
    config = write_config(config_toml)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "signaling.cli", "serve", "--config", str(config)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        match = re.search(r"serving on (http://\S+)", line)
        if match:
            threading.Thread(target=_drain_output, args=(proc, lines), daemon=True).start()
            return proc, match.group(1).rstrip("/"), lines
    proc.wait()
    raise AssertionError("server did not start:\n" + "".join(lines))


def _drain_output(proc: subprocess.Popen[str], lines: list[str]) -> None:
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)


async def test_sigterm_lets_speaking_calls_finish_then_closes_them():
    proc, url, lines = _start_server(
        f"""[server]
port = 0
drain_timeout_s = {DRAIN_TIMEOUT_S}
[webrtc]
loopback_only = true
[engine]
backend = "fake"
[fake]
ttfa_ms = 20
rtf = 0.05
"""
    )
    restore = patch_aioice_loopback()  # the peers offer 127.0.0.1 like the server does
    try:
        async with aiohttp.ClientSession() as http:
            peers = [HttpPeer(http, url) for _ in range(2)]
            for peer in peers:
                await peer.connect()
            utterances = [await peer.speak(TEXT) for peer in peers]
            for peer, utterance_id in zip(peers, utterances, strict=True):
                await peer.wait_event("speech.started", utterance_id, timeout_s=10)

            proc.send_signal(signal.SIGTERM)
            refused = await _post_call_until_refused(http, url)
            assert refused.status == 503 and refused.headers["Retry-After"].isdigit()
            assert (await refused.json())["error"]["code"] == "draining"
            async with http.get(f"{url}/readyz") as ready:
                assert ready.status == 503 and (await ready.json())["reason"] == "draining"

            for peer, utterance_id in zip(peers, utterances, strict=True):
                done = await peer.wait_event("speech.done", utterance_id, timeout_s=DRAIN_TIMEOUT_S)
                closing = await peer.wait_event("call.closing", timeout_s=DRAIN_TIMEOUT_S)
                assert closing == {"type": "call.closing", "reason": "server_draining"}
                assert peer.events.index(done) < peer.events.index(closing)
                assert done["played_ms"] >= 0.9 * 65 * len(TEXT)  # the whole utterance was heard
                assert not [e for e in peer.events if e["type"] == "speech.interrupted"]
            returncode = await asyncio.to_thread(proc.wait, DRAIN_TIMEOUT_S + 10)
            assert returncode == 0, "".join(lines[-30:])
            for peer in peers:
                peer.call_id = ""  # the server is gone: nothing to hang up
                await peer.close()
    finally:
        restore()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def _post_call_until_refused(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    """The signal is handled asynchronously: offer (an empty, invalid body) until the server says 503."""
    for _ in range(100):
        resp = await http.post(f"{url}/v1/calls", data="", headers={"Content-Type": "application/sdp"})
        await resp.read()
        if resp.status == 503:
            return resp
        await asyncio.sleep(0.05)
    raise AssertionError("new calls were never refused")


async def test_drain_timeout_cuts_a_long_utterance():
    async with api(server={"drain_timeout_s": 0.5}) as client:
        call_id, peer = await open_call(client)
        spoken = await client.post(f"/v1/calls/{call_id}/speak", json={"text": TEXT * 5})
        utterance_id = (await spoken.json())["utterance_id"]
        await peer.wait_event("speech.started", utterance_id=utterance_id)
        await client.app[DRAIN].run()
        closing = await peer.wait_event("call.closing")
        assert closing["reason"] == "server_draining"
        assert not [e for e in peer.events if e["type"] == "speech.done"]  # cut, not finished
        cut = await peer.wait_event("speech.interrupted", utterance_id=utterance_id)
        assert peer.events.index(cut) < peer.events.index(closing)
        await expect_error(await client.get(f"/v1/calls/{call_id}"), 404, "unknown_call")
        offer = await PeerClient().offer()
        refused = await client.post("/v1/calls", data=offer, headers={"Content-Type": "application/sdp"})
        await expect_error(refused, 503, "draining")
        assert refused.headers["Retry-After"].isdigit()
        ready = await client.get("/readyz")
        assert ready.status == 503 and (await ready.json())["reason"] == "draining"


async def test_drain_finishes_the_current_utterance_not_the_queued_ones():
    # rtf 1: the current utterance is still being synthesized when the drain starts, so the next one
    # still waits for its turn (nothing of it in the ring)
    async with api(server={"drain_timeout_s": 30.0}, fake={"rtf": 1.0}) as client:
        call_id, peer = await open_call(client)
        speak = f"/v1/calls/{call_id}/speak"
        first, second = [
            (await (await client.post(speak, json={"text": text})).json())["utterance_id"]
            for text in ("Short one.", "Queued behind it.")
        ]
        await peer.wait_event("speech.started", utterance_id=first)
        await client.app[DRAIN].run()
        await peer.wait_event("speech.done", utterance_id=first)
        await peer.wait_event("call.closing")
        kinds = [e["type"] for e in peer.events if e.get("utterance_id") == second]
        assert kinds == ["speech.queued", "speech.interrupted"], peer.events  # never started
        assert [e["type"] for e in peer.events][-1] == "call.closing"


async def test_drain_with_no_calls_returns_at_once():
    async with api() as client:
        await client.app[DRAIN].run()
        assert client.app[DRAIN].draining
        health = await client.get("/healthz")
        assert health.status == 200  # liveness is not readiness
