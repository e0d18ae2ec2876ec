"""CPU per call and underruns with 1/4/8 calls speaking back to back, bundled Piper voice.

    .venv/bin/python -m bench.call_load [--calls 1 4 8] [--seconds 20] [--workers 1]

`voicertc serve` (Piper, loopback-only ICE, uvloop) runs as a child process: the server's CPU is
measured alone. This process holds the N aiortc client peers (bench/peer.py, they decode what they
receive). For each N: open N calls over `POST /v1/calls`; in each, keep two utterances queued
(`POST .../speak`; a new one whenever one ends), for `--seconds`; then read the counters and hang up.
All N calls start speaking at the same moment (the worst onset: N first chunks compete); one more run
at the top load starts call i `i * --stagger-s` later, to tell the onset burst from the steady state.

Measured over the speaking window:
- server CPU: user + system seconds of the server process (/proc/<pid>/stat, all threads: event loop,
  Piper engine, aiortc's encoder executor), per call-second = cpu_s / (N * window_s), and as % of one core.
- per call, from `GET /v1/calls/{id}` (SpeechTrack stats): frames_sent and underrun_frames (silence
  frames sent while an utterance was mid-playback), as deltas over the window.
- played_s: audio sent of the utterances that played in the window (`speech.done` played_ms, plus the
  played_ms of the one cut by the interrupt that ends the window), per call; speaking % (the lowest
  call's) = played_s / window_s shows the calls really spoke back to back.
- first ttfa: the server's `speech.started` ttfa_ms of each call's first utterance (all N calls ask
  at the same moment: the engine's contention at onset).
Prints a table; writes bench/results/call_load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import time
from collections import deque
from typing import Any

import aiohttp

from bench.peer import PIPER_CONFIG_TOML, HttpPeer, process_cpu_s, served
from bench.report import summary, table, write_json
from voicertc.webrtc.loopback import patch_aioice_loopback

SENTENCES = [
    "The weather tomorrow will be mostly sunny in the morning.",
    "I can help you book a table for dinner tonight, if you like.",
    "Your package left the warehouse and should arrive on Thursday.",
    "Please hold on for a moment while I look that up for you.",
    "The next train to the city centre leaves in twelve minutes.",
    "Thanks for calling, is there anything else I can do for you today?",
]
TERMINAL = ("speech.done", "speech.interrupted", "error")
QUEUED_UTTERANCES = 2


async def wait_terminal(peer: HttpPeer, utterance_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
    async def find() -> dict[str, Any]:
        while True:
            for event in peer.events:
                if event["type"] in TERMINAL and event.get("utterance_id") == utterance_id:
                    return event
            peer.event_arrived.clear()
            await peer.event_arrived.wait()

    return await asyncio.wait_for(find(), timeout_s)


async def speak_back_to_back(peer: HttpPeer, offset: int, delay_s: float, stop_s: float) -> None:
    """After `delay_s`, keep QUEUED_UTTERANCES queued in the call until `stop_s` (monotonic)."""
    await asyncio.sleep(delay_s)
    texts = itertools.cycle(SENTENCES[offset % len(SENTENCES) :] + SENTENCES[: offset % len(SENTENCES)])
    queued = deque([await peer.speak(next(texts)) for _ in range(QUEUED_UTTERANCES)])
    while True:
        remaining_s = stop_s - time.monotonic()
        if remaining_s <= 0:
            return
        try:
            await asyncio.wait_for(wait_terminal(peer, queued[0]), remaining_s)
        except TimeoutError:
            return
        queued.popleft()
        queued.append(await peer.speak(next(texts)))


def window_events(peer: HttpPeer, first_event: int) -> tuple[list[float], float, int]:
    """(ttfa_ms of started utterances, played seconds of finished ones, errors) since `first_event`.

    A queued utterance's ttfa counts from when the one before it finished playing.
    """
    events = peer.events[first_event:]
    ttfa = [float(e["ttfa_ms"]) for e in events if e["type"] == "speech.started"]
    played_s = sum(float(e["played_ms"]) for e in events if e["type"] == "speech.done") / 1000.0
    errors = sum(1 for e in events if e["type"] == "error")
    return ttfa, played_s, errors


async def run_load(
    http: aiohttp.ClientSession, url: str, pid: int, calls: int, seconds: float, stagger_s: float = 0.0
) -> dict:
    """N calls speaking for `seconds`; call i starts `i * stagger_s` into the window."""
    peers = [HttpPeer(http, url) for _ in range(calls)]
    try:
        await asyncio.gather(*(p.connect() for p in peers))
        await asyncio.sleep(1.0)  # let every call settle into its frame clock
        before = await asyncio.gather(*(p.info() for p in peers))
        first_events = [len(p.events) for p in peers]
        cpu0, client_cpu0, t0 = process_cpu_s(pid), process_cpu_s(os.getpid()), time.monotonic()
        await asyncio.gather(
            *(speak_back_to_back(p, i, i * stagger_s, t0 + seconds) for i, p in enumerate(peers))
        )
        window_s = time.monotonic() - t0
        cpu_s, client_cpu_s = process_cpu_s(pid) - cpu0, process_cpu_s(os.getpid()) - client_cpu0
        after = await asyncio.gather(*(p.info() for p in peers))
        cut = await asyncio.gather(*(p.interrupt() for p in peers))  # the playing one's played_ms
    finally:
        await asyncio.gather(*(p.close() for p in peers), return_exceptions=True)
    per_call = []
    first_ttfa: list[float] = []
    for peer, b, a, first, c in zip(peers, before, after, first_events, cut, strict=True):
        ttfa, played_s, errors = window_events(peer, first)
        first_ttfa += ttfa[:1]
        played_s += float(c["played_ms"]) / 1000.0
        per_call.append(
            {
                "frames_sent": a["frames_sent"] - b["frames_sent"],
                "underrun_frames": a["underrun_frames"] - b["underrun_frames"],
                "played_s": round(played_s, 2),
                "speaking_fraction": round(played_s / window_s, 3),
                "utterances_started": len(ttfa),
                "errors": errors,
            }
        )
    return {
        "calls": calls,
        "stagger_s": stagger_s,
        "window_s": window_s,
        "server_cpu_s": cpu_s,
        "server_cpu_s_per_call_s": cpu_s / (calls * window_s),
        "server_cpu_pct_of_core": 100.0 * cpu_s / window_s,
        "client_cpu_s": client_cpu_s,
        "first_ttfa_ms": summary(first_ttfa) if first_ttfa else None,
        "per_call": per_call,
    }


def _row(result: dict) -> dict[str, object]:
    per_call = result["per_call"]
    return {
        "calls": f"{result['calls']}"
        + (f" (+{result['stagger_s']:g} s each)" if result["stagger_s"] else ""),
        "window s": result["window_s"],
        "server CPU % core": result["server_cpu_pct_of_core"],
        "CPU s per call-s": result["server_cpu_s_per_call_s"],
        "underruns (per call)": " ".join(str(c["underrun_frames"]) for c in per_call),
        "frames/call": round(sum(c["frames_sent"] for c in per_call) / len(per_call)),
        "speaking %": 100.0 * min(c["speaking_fraction"] for c in per_call),
        "first ttfa p50 ms": result["first_ttfa_ms"]["p50"] if result["first_ttfa_ms"] else "",
        "first ttfa max ms": result["first_ttfa_ms"]["max"] if result["first_ttfa_ms"] else "",
        "errors": sum(c["errors"] for c in per_call),
    }


async def main(call_counts: list[int], seconds: float, stagger_s: float, workers: int) -> None:
    patch_aioice_loopback()  # the client peers offer 127.0.0.1 like the server does
    results = []
    config = PIPER_CONFIG_TOML.replace('backend = "piper"\n', f'backend = "piper"\nworkers = {workers}\n')
    with served(config) as (url, pid):
        async with aiohttp.ClientSession() as http:
            warm = await run_load(http, url, pid, 1, 3.0)  # load the voice, warm every path
            del warm
            for calls in call_counts:
                results.append(await run_load(http, url, pid, calls, seconds))
                await asyncio.sleep(1.0)
            if stagger_s > 0:  # the same top load with onsets spread out: steady state vs onset burst
                results.append(await run_load(http, url, pid, max(call_counts), seconds, stagger_s))
    print(table([_row(r) for r in results], list(_row(results[0]))))  # noqa: T201 - benchmark output
    name = "call_load" if workers == 1 else f"call_load_w{workers}"
    path = write_json(name, {"seconds": seconds, "workers": workers, "results": results})
    print("wrote", path)  # noqa: T201


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument(
        "--stagger-s",
        type=float,
        default=0.25,
        help="extra run at the top load, call i starting i*this later",
    )
    parser.add_argument("--workers", type=int, default=1, help="engine.workers of the server")
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.seconds, args.stagger_s, args.workers))
