"""Is the first utterance after the server starts as fast as the later ones? Bundled Piper voice.

    .venv/bin/python -m bench.first_utterance [--servers 6] [--utterances 6]

Each server is a fresh process (a cold start is a process's first time through every path: imports
done lazily, onnxruntime's first runs of new shapes, the first resampler and Opus encoder, the first
RTP packet). In each, the server (`VoiceServer`, as in bench/call_latency.py) starts, one aiortc peer
calls it, and the peer speaks `--utterances` times (idle 0.2-0.5 s, speak, first RTP packet, play
0.3 s, interrupt), measured as in bench/call_latency.py: speak -> first RTP packet leaving the server,
its parts (the engine's first step: wall and engine-thread CPU time; the frame; the encode) and the
server's ttfa.
Per server: utterance 1 minus the median of the others (paired, so the machine's load at that moment
mostly cancels). Prints a table; writes bench/results/first_utterance.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import aiohttp
import numpy as np

from bench.call_latency import SendProbe, one_run
from bench.peer import REPO, HttpPeer
from bench.report import summary, table, write_json
from signaling.embed import VoiceServer
from voicertc.config import config_from_dict

TEXT = "I can help you book a table for dinner tonight."
KEYS = (
    "first_rtp_ms",
    "first_frame_ms",
    "server_ttfa_ms",
    "engine_step_ms",
    "engine_step_cpu_ms",
    "encode_ms",
    "http_202_ms",
)


class StepTimer:
    """Times the engine's first model step of each utterance (a bench reach-in, the package untouched)."""

    def __init__(self, worker: Any) -> None:
        self.first_step_ms: float | None = None
        self.first_step_cpu_ms: float | None = None
        original = worker._run_batch

        def run_batch(batch: list[Any]) -> None:
            started, cpu_started = time.monotonic(), time.thread_time()
            original(batch)
            if self.first_step_ms is None:
                self.first_step_ms = 1000.0 * (time.monotonic() - started)
                self.first_step_cpu_ms = 1000.0 * (time.thread_time() - cpu_started)

        worker._run_batch = run_batch


async def child(utterances: int) -> list[dict[str, float]]:
    config = config_from_dict(
        {
            "server": {"port": 0},
            "webrtc": {"loopback_only": True},
            "engine": {"backend": "piper"},
            "logging": {"level": "ERROR"},
        }
    )
    server = VoiceServer(config)
    url = await server.start()
    timer = StepTimer(server.engine)
    runs: list[dict[str, float]] = []
    async with aiohttp.ClientSession() as http:
        peer = HttpPeer(http, url)
        try:
            await peer.connect()
            agent_call = await server.next_call(timeout_s=10)
            probe = SendProbe(agent_call._call)
            await asyncio.sleep(1.0)
            for _ in range(utterances):
                timer.first_step_ms = None
                run = await one_run(peer, probe, TEXT)
                run["engine_step_ms"] = timer.first_step_ms or float("nan")
                run["engine_step_cpu_ms"] = timer.first_step_cpu_ms or float("nan")
                runs.append(run)
        finally:
            await peer.close()
            await server.stop()
    return runs


def run_children(servers: int, utterances: int) -> list[list[dict[str, float]]]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    results = []
    for _ in range(servers):
        out = subprocess.run(
            [sys.executable, "-m", "bench.first_utterance", "--child", "--utterances", str(utterances)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results


def report(results: list[list[dict[str, float]]]) -> tuple[list[dict[str, object]], dict[str, Any]]:
    rows: list[dict[str, object]] = []
    record: dict[str, Any] = {}
    for key in KEYS:
        first = [r[0][key] for r in results]
        later = [float(np.median([u[key] for u in r[1:]])) for r in results]
        excess = [f - lat for f, lat in zip(first, later, strict=True)]
        record[key] = {
            "first": summary(first),
            "later_median": summary(later),
            "first_minus_later": summary(excess),
        }
        rows.append(
            {
                "measure": key,
                "first p50": record[key]["first"]["p50"],
                "later p50": record[key]["later_median"]["p50"],
                "first - later p50": record[key]["first_minus_later"]["p50"],
                "first - later max": record[key]["first_minus_later"]["max"],
            }
        )
    return rows, record


def main(servers: int, utterances: int) -> None:
    results = run_children(servers, utterances)
    rows, record = report(results)
    print(table(rows, list(rows[0])))  # noqa: T201 - benchmark output
    path = write_json(
        "first_utterance",
        {"servers": servers, "utterances": utterances, "text": TEXT, "summary": record, "raw": results},
    )
    print("wrote", path, "loadavg", os.getloadavg())  # noqa: T201


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--servers", type=int, default=6)
    parser.add_argument("--utterances", type=int, default=6)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args.utterances))))  # noqa: T201 - read by the parent
    else:
        main(args.servers, args.utterances)
