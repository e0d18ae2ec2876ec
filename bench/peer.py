"""A Python WebRTC peer that calls a voicertc server over its HTTP API, for the call benchmarks.

It plays the browser: offers recvonly audio plus the `events` data channel, posts the offer to
`POST /v1/calls` (JSON), keeps draining the received track (so aiortc's receiver works as in a real
call) and collects the server's data-channel events. Speaking goes through the HTTP API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
from aiortc import (
    RTCConfiguration,
    RTCIceServer,
    RTCIceTransportPolicy,
    RTCPeerConnection,
    RTCSessionDescription,
)
from aiortc.mediastreams import MediaStreamError

# Debian's Chromium (never a downloaded browser) and the flags that make WebRTC work headless.
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
]

REPO = Path(__file__).resolve().parents[1]
PIPER_CONFIG_TOML = """\
[server]
port = 0
[webrtc]
loopback_only = true
[engine]
backend = "piper"
[logging]
level = "WARNING"
"""


@contextlib.contextmanager
def served(
    config_toml: str = PIPER_CONFIG_TOML, log_lines: deque[str] | None = None
) -> Iterator[tuple[str, int]]:
    """`voicertc serve` in a child process on a free loopback port: yields (base URL, pid). Its log
    lines go to `log_lines` when given (a bounded deque), else nowhere."""
    config = Path(tempfile.mkdtemp()) / "config.toml"
    config.write_text(config_toml)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "signaling.cli", "serve", "--config", str(config)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = _wait_for_url(proc, log_lines)
        # keep draining its log so a chatty server never blocks on a full pipe
        sink = log_lines.append if log_lines is not None else (lambda line: None)
        threading.Thread(target=_drain_log, args=(proc, sink), daemon=True).start()
        yield url.rstrip("/"), proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _drain_log(proc: subprocess.Popen[str], sink: Callable[[str], None]) -> None:
    for line in proc.stdout:  # type: ignore[union-attr]
        sink(line)


def _wait_for_url(proc: subprocess.Popen[str], log_lines: deque[str] | None = None) -> str:
    lines = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if log_lines is not None:
            log_lines.append(line)
        match = re.search(r"serving on (http://\S+)", line)
        if match:
            return match.group(1)
    raise RuntimeError("server did not start:\n" + "".join(lines))


def process_cpu_s(pid: int) -> float:
    """user + system CPU seconds of a process so far (/proc/<pid>/stat, all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class HttpPeer:
    """One call from the client side. Owned by the benchmark's event loop."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        base_url: str,
        ice_servers: list[RTCIceServer] | None = None,
        relay_only: bool = False,
    ) -> None:
        """`relay_only` gathers only TURN relay candidates from `ice_servers` (a caller behind a NAT
        that only a relay crosses)."""
        self.http = http
        self.base_url = base_url.rstrip("/")
        policy = RTCIceTransportPolicy.RELAY if relay_only else RTCIceTransportPolicy.ALL
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=ice_servers or [], iceTransportPolicy=policy))
        self.call_id = ""
        self.events: list[dict[str, Any]] = []
        self.event_arrived = asyncio.Event()
        self.frames_received = 0
        self._reader: asyncio.Task[None] | None = None
        self.channel = self.pc.createDataChannel("events")
        self.channel.on("message", self._on_message)
        self.pc.addTransceiver("audio", direction="recvonly")
        self.pc.on("track", self._on_track)

    async def connect(self, timeout_s: float = 20.0) -> None:
        """Offer, apply the answer, wait for the data channel to open."""
        await self.pc.setLocalDescription(await self.pc.createOffer())
        body = {"type": "offer", "sdp": self.pc.localDescription.sdp}
        async with self.http.post(f"{self.base_url}/v1/calls", json=body) as resp:
            if resp.status != 201:
                raise RuntimeError(f"POST /v1/calls -> {resp.status}: {await resp.text()}")
            answer = await resp.json()
        self.call_id = answer["id"]
        opened = asyncio.Event()
        self.channel.on("open", opened.set)
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
        if self.channel.readyState != "open":
            await asyncio.wait_for(opened.wait(), timeout_s)

    async def speak(self, text: str, **options: object) -> str:
        """`POST /v1/calls/{id}/speak` (speak options such as `speed` as keywords); the utterance id."""
        url = f"{self.base_url}/v1/calls/{self.call_id}/speak"
        async with self.http.post(url, json={"text": text, **options}) as resp:
            if resp.status != 202:
                raise RuntimeError(f"speak -> {resp.status}: {await resp.text()}")
            return str((await resp.json())["utterance_id"])

    async def interrupt(self) -> dict[str, Any]:
        async with self.http.post(f"{self.base_url}/v1/calls/{self.call_id}/interrupt") as resp:
            return dict(await resp.json())

    async def info(self) -> dict[str, Any]:
        async with self.http.get(f"{self.base_url}/v1/calls/{self.call_id}") as resp:
            return dict(await resp.json())

    async def wait_event(self, kind: str, utterance_id: str | None = None, timeout_s: float = 30.0) -> dict:
        async def find() -> dict:
            while True:
                for event in self.events:
                    if event["type"] == kind and utterance_id in (None, event.get("utterance_id")):
                        return event
                self.event_arrived.clear()
                await self.event_arrived.wait()

        return await asyncio.wait_for(find(), timeout_s)

    def _on_track(self, track: Any) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._drain(track))

    async def _drain(self, track: Any) -> None:
        with contextlib.suppress(MediaStreamError, asyncio.CancelledError):
            while True:
                await track.recv()
                self.frames_received += 1

    def _on_message(self, message: str) -> None:
        self.events.append(json.loads(message))
        self.event_arrived.set()

    async def close(self) -> None:
        """Hang up over HTTP (ignoring a call that is already gone), then close the peer connection."""
        if self.call_id:
            with contextlib.suppress(aiohttp.ClientError):
                async with self.http.delete(f"{self.base_url}/v1/calls/{self.call_id}"):
                    pass
        if self._reader is not None:
            self._reader.cancel()
        await self.pc.close()
