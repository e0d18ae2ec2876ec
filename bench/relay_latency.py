"""Relay vs direct on loopback: what a TURN relay (a real coturn) costs a call.

    .venv/bin/python -m bench.relay_latency [--calls 8] [--runs 3] [--utterances 4] [--engine piper|fake]

`voicertc serve` runs as a child process (loopback-only ICE, `[turn]` pointing at a coturn started on
loopback by bench/coturn.py); this process holds N aiortc callers (bench/peer.py). Direct: the callers
connect to the server's host candidate. Relay: each caller takes its credentials from
`GET /v1/ice-servers` and gathers with a relay-only policy, so every packet goes caller -> coturn ->
server and back. For each mode and run: N calls at once, each speaking `--utterances` sentences one
after the other.

Measured:
- TTFA at the caller: `POST .../speak` sent -> the first decoded audio frame above -40 dBFS at the
  caller (so the relay hop, the jitter buffer and decoding are in it), every utterance of every call.
- server CPU per call: user + system seconds of the server process over the speaking window / (N x
  window), as % of one core; coturn's CPU the same way (relay mode).
Prints a table; writes bench/results/relay_latency.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from typing import Any

import aiohttp
import numpy as np
from aiortc import RTCIceServer
from aiortc.mediastreams import MediaStreamError

from bench.coturn import Turn, coturn
from bench.peer import HttpPeer, process_cpu_s, served
from bench.report import summary, table, write_json
from voicertc.webrtc.loopback import patch_aioice_loopback

SENTENCES = [
    "The weather tomorrow will be mostly sunny.",
    "Your package should arrive on Thursday.",
    "The next train leaves in twelve minutes.",
    "Is there anything else I can do for you?",
]
HEARD_DBFS = -40.0
GAP_S = 0.3  # between one utterance's end and the next request


class TimedPeer(HttpPeer):
    """An HttpPeer that notes when loud audio arrives (monotonic seconds of each loud frame's arrival)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loud_since: float | None = None  # the request time we wait for audio after
        self.heard = asyncio.Event()
        self.heard_at = 0.0

    async def _drain(self, track: Any) -> None:
        threshold = 32768.0 * 10 ** (HEARD_DBFS / 20)
        with contextlib.suppress(MediaStreamError, asyncio.CancelledError):
            while True:
                frame = await track.recv()
                self.frames_received += 1
                if self.loud_since is None or self.heard.is_set():
                    continue
                pcm = frame.to_ndarray().astype(np.float32)
                if float(np.sqrt(np.mean(pcm * pcm))) > threshold:
                    self.heard_at = time.monotonic()
                    self.heard.set()

    async def timed_utterance(self, text: str) -> float:
        """Speak `text`; the ms from the request to the first loud frame; returns once it is done."""
        self.heard.clear()
        self.loud_since = t0 = time.monotonic()
        utterance_id = await self.speak(text)
        await asyncio.wait_for(self.heard.wait(), 30)
        await self.wait_event("speech.done", utterance_id, timeout_s=60)
        self.loud_since = None
        return (self.heard_at - t0) * 1000.0


async def _ice(http: aiohttp.ClientSession, url: str) -> list[RTCIceServer]:
    async with http.get(f"{url}/v1/ice-servers") as resp:
        servers = (await resp.json())["ice_servers"]
    return [
        RTCIceServer(urls=s["urls"], username=s.get("username"), credential=s.get("credential"))
        for s in servers
    ]


async def run_mode(
    http: aiohttp.ClientSession, url: str, pid: int, turn: Turn, relay: bool, calls: int, utterances: int
) -> dict[str, Any]:
    peers = []
    for _ in range(calls):
        ice = await _ice(http, url) if relay else None
        peers.append(TimedPeer(http, url, ice_servers=ice, relay_only=relay))
    try:
        await asyncio.gather(*(p.connect() for p in peers))
        await asyncio.sleep(1.0)  # every call settled into its frame clock
        cpu0, turn_cpu0, t0 = process_cpu_s(pid), process_cpu_s(turn.pid), time.monotonic()

        async def speak_all(i: int, peer: TimedPeer) -> list[float]:
            out = []
            for u in range(utterances):
                out.append(await peer.timed_utterance(SENTENCES[(i + u) % len(SENTENCES)]))
                await asyncio.sleep(GAP_S)
            return out

        ttfa = [
            ms
            for per_call in await asyncio.gather(*(speak_all(i, p) for i, p in enumerate(peers)))
            for ms in per_call
        ]
        window_s = time.monotonic() - t0
        cpu_s, turn_cpu_s = process_cpu_s(pid) - cpu0, process_cpu_s(turn.pid) - turn_cpu0
    finally:
        await asyncio.gather(*(p.close() for p in peers), return_exceptions=True)
    return {
        "mode": "relay" if relay else "direct",
        "calls": calls,
        "window_s": window_s,
        "ttfa_ms": ttfa,
        "server_cpu_pct_per_call": 100.0 * cpu_s / (calls * window_s),
        "coturn_cpu_pct_per_call": 100.0 * turn_cpu_s / (calls * window_s),
    }


def _row(mode: str, runs: list[dict[str, Any]]) -> dict[str, object]:
    ttfa = summary([ms for r in runs for ms in r["ttfa_ms"]])
    server = summary([r["server_cpu_pct_per_call"] for r in runs])
    relay = summary([r["coturn_cpu_pct_per_call"] for r in runs])
    return {
        "mode": mode,
        "runs": len(runs),
        "utterances": ttfa["n"],
        "TTFA p50 ms": ttfa["p50"],
        "TTFA p95 ms": ttfa["p95"],
        "server CPU %/call (p50)": server["p50"],
        "coturn CPU %/call (p50)": relay["p50"],
    }


async def main(calls: int, runs: int, utterances: int, engine: str) -> None:
    patch_aioice_loopback()  # the callers' host candidates are 127.0.0.1, like the server's
    results: dict[str, list[dict[str, Any]]] = {"direct": [], "relay": []}
    with coturn() as turn:
        config = f"""[server]
port = 0
[webrtc]
loopback_only = true
[engine]
backend = "{engine}"
[limits]
max_pending_calls = {calls}
[turn]
secret = "{turn.secret}"
urls = ["{turn.url}"]
[logging]
level = "WARNING"
"""
        with served(config) as (url, pid):
            async with aiohttp.ClientSession() as http:
                await run_mode(http, url, pid, turn, False, 1, 1)  # warm up: voice loaded, paths taken
                for _ in range(runs):  # interleaved, so load drifts hit both modes alike
                    for mode in ("direct", "relay"):
                        results[mode].append(
                            await run_mode(http, url, pid, turn, mode == "relay", calls, utterances)
                        )
                        await asyncio.sleep(1.0)
    rows = [_row(mode, runs_) for mode, runs_ in results.items()]
    print(table(rows, list(rows[0])))  # noqa: T201 - benchmark output
    path = write_json(
        "relay_latency",
        {
            "engine": engine,
            "calls": calls,
            "utterances_per_call": utterances,
            "summary": rows,
            "runs": results,
        },
    )
    print("wrote", path, "load average", os.getloadavg())  # noqa: T201


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--utterances", type=int, default=4, help="per call and run, one after the other")
    parser.add_argument("--engine", default="piper", choices=["piper", "fake"])
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.runs, args.utterances, args.engine))
