"""Soak: 8 calls speaking for minutes with random interrupts, hang-ups and new calls, bundled Piper voice.

    .venv/bin/python -m bench.soak [--minutes 10] [--calls 8] [--seed 1] [--pathological-rate 0.05]

`voicertc serve` (Piper, loopback-only ICE) runs as a child process; this process holds the aiortc
client peers (bench/peer.py). Each of `--calls` slots loops until the time is up: open a call, speak
3-12 utterances (a sentence, sometimes a paragraph, with `--pathological-rate` one of issue 11's
expanding texts), interrupting 20 % of them after 0.3-2 s, then hang up (`DELETE`; 1 in 10 just
vanishes: the peer closes without a word, the server must notice) and start a new call 0.5-3 s later.

Measured:
- underrun frames (silence sent mid-utterance, `GET /v1/calls/{id}` before each hang-up; the call's
  counter covers all its speech, interrupted or not), utterances, interrupts, error events, TTFA p50/p95;
- server RSS every 5 s (/proc/<pid>/statm): the first `--warmup-frac` of the run is warm-up; growth =
  last minute's mean vs the first minute after warm-up (target flat, <= 5 %);
- server threads and open fds: baseline after a warm-up (`--calls` calls speak once together and
  hang up, so thread pools have grown to their working size) and at the end once every call is gone
  (vanished ones included), both with this process's HTTP sessions closed; target back to baseline.
Prints a table; writes bench/results/soak.json (with the load average).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.call_load import SENTENCES, wait_terminal
from bench.peer import PIPER_CONFIG_TOML, HttpPeer, served
from bench.report import summary, table, write_json
from bench.starvation import PATHOLOGICAL, engine_steps, rss_mb
from voicertc.webrtc.loopback import patch_aioice_loopback

PARAGRAPH = " ".join(SENTENCES)
SAMPLE_S = 5.0
CONNECTING_AT_ONCE = 3  # below the server's per-client cap on unconnected calls (limits.max_pending_calls)


def threads_and_fds(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


def thread_and_fd_kinds(pid: int) -> dict[str, dict[str, int]]:
    """Threads by name and fds by kind (socket, pipe, anon_inode:[eventpoll], file...): what changed."""
    names: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            name = (task / "comm").read_text().strip().rstrip("0123456789_")
            names[name] = names.get(name, 0) + 1
    kinds: dict[str, int] = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            kind = target.split(":")[0] if ":" in target and not target.startswith("/") else "file"
            kinds[kind] = kinds.get(kind, 0) + 1
    return {"threads": names, "fds": kinds}


class Totals:
    """Counters over the whole soak. Owned by the event loop."""

    def __init__(self) -> None:
        self.calls = 0
        self.vanished = 0
        self.utterances = 0
        self.interrupts = 0
        self.errors: dict[str, int] = {}
        self.underrun_frames = 0
        self.underrun_calls = 0
        self.frames_sent = 0
        self.ttfa_ms: list[float] = []
        self.failures: list[str] = []


def pick_text(rng: random.Random, pathological_rate: float) -> str:
    roll = rng.random()
    if roll < pathological_rate:
        return rng.choice(list(PATHOLOGICAL.values()))
    if roll < pathological_rate + 0.15:
        return PARAGRAPH
    return rng.choice(SENTENCES)


async def one_call(
    http: aiohttp.ClientSession,
    url: str,
    rng: random.Random,
    rate: float,
    totals: Totals,
    gate: asyncio.Semaphore,
) -> None:
    peer = HttpPeer(http, url)
    vanish = rng.random() < 0.1
    try:
        async with gate:
            await peer.connect()
        totals.calls += 1
        for _ in range(rng.randint(3, 12)):
            utterance_id = await peer.speak(pick_text(rng, rate))
            totals.utterances += 1
            if rng.random() < 0.2:
                with contextlib.suppress(TimeoutError):
                    await peer.wait_event("speech.started", utterance_id, timeout_s=30.0)
                await asyncio.sleep(rng.uniform(0.3, 2.0))
                await peer.interrupt()
                totals.interrupts += 1
            await wait_terminal(peer, utterance_id, timeout_s=180.0)
        info = await peer.info()
        totals.underrun_frames += int(info["underrun_frames"])
        totals.underrun_calls += int(info["underrun_frames"] > 0)
        totals.frames_sent += int(info["frames_sent"])
    finally:
        for event in peer.events:
            if event["type"] == "speech.started":
                totals.ttfa_ms.append(float(event["ttfa_ms"]))
            elif event["type"] == "error":
                totals.errors[event["code"]] = totals.errors.get(event["code"], 0) + 1
        if vanish:
            totals.vanished += 1
            if peer._reader is not None:
                peer._reader.cancel()
            await peer.pc.close()  # no DELETE: the server finds out on its own
        else:
            await peer.close()


async def slot(
    http: aiohttp.ClientSession,
    url: str,
    seed: int,
    rate: float,
    end_s: float,
    totals: Totals,
    gate: asyncio.Semaphore,
) -> None:
    rng = random.Random(seed)
    await asyncio.sleep(rng.uniform(0.0, 2.0))
    while time.monotonic() < end_s:
        try:
            await asyncio.wait_for(
                one_call(http, url, rng, rate, totals, gate), max(1.0, end_s - time.monotonic())
            )
        except TimeoutError:
            pass  # the soak is over mid-call: hung up by the wait_for's cancel (close in finally)
        except Exception as exc:  # noqa: BLE001 - a failed call is counted, the slot goes on
            totals.failures.append(f"{type(exc).__name__}: {exc}")
        await asyncio.sleep(rng.uniform(0.5, 3.0))


async def sample_rss(pid: int, t0: float, end_s: float, samples: list[tuple[float, float]]) -> None:
    while time.monotonic() < end_s:
        samples.append((time.monotonic() - t0, rss_mb(pid)))
        await asyncio.sleep(SAMPLE_S)


async def active_calls(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    line = next(line for line in text.splitlines() if line.startswith("voicertc_active_calls "))
    return int(float(line.split()[1]))


async def wait_no_calls(http: aiohttp.ClientSession, url: str, timeout_s: float) -> float:
    """Seconds until the server has no call left (it is polled once a second: it is another process)."""
    started = time.monotonic()
    for _ in range(int(timeout_s)):
        if not await active_calls(http, url):
            break
        await asyncio.sleep(1.0)
    return time.monotonic() - started


def rss_growth(samples: list[tuple[float, float]], warmup_s: float) -> dict[str, float]:
    t = np.array([s[0] for s in samples])
    rss = np.array([s[1] for s in samples])
    after = t >= warmup_s
    first = rss[after & (t < warmup_s + 60.0)]
    last = rss[t >= t[-1] - 60.0]
    start_mb, end_mb = float(first.mean()), float(last.mean())
    return {
        "warmup_s": warmup_s,
        "first_minute_after_warmup_mb": start_mb,
        "last_minute_mb": end_mb,
        "growth_pct": 100.0 * (end_mb - start_mb) / start_mb,
        "max_mb": float(rss.max()),
    }


async def warm_up(url: str, calls: int) -> None:
    """`calls` calls at once, each speaking one sentence, then hung up: thread pools grow to their
    working size, so the baseline is the server's steady state with no call (not its first minute)."""
    async with aiohttp.ClientSession() as http:
        peers = [HttpPeer(http, url) for _ in range(calls)]
        try:
            for peer in peers:  # one at a time: the server caps a client's unconnected calls
                await peer.connect()
            ids = await asyncio.gather(*(p.speak("Warm up, please.") for p in peers))
            await asyncio.gather(
                *(wait_terminal(p, i, timeout_s=60.0) for p, i in zip(peers, ids, strict=True))
            )
        finally:
            await asyncio.gather(*(p.close() for p in peers), return_exceptions=True)
        await wait_no_calls(http, url, 30.0)
    await asyncio.sleep(3.0)


async def main(minutes: float, calls: int, seed: int, rate: float, warmup_frac: float) -> None:
    patch_aioice_loopback()
    seconds = 60.0 * minutes
    totals = Totals()
    samples: list[tuple[float, float]] = []
    with served(PIPER_CONFIG_TOML) as (url, pid):
        await warm_up(url, calls)
        baseline, baseline_kinds = threads_and_fds(pid), thread_and_fd_kinds(pid)
        rss_baseline = rss_mb(pid)
        async with aiohttp.ClientSession() as http:
            gate = asyncio.Semaphore(CONNECTING_AT_ONCE)
            t0 = time.monotonic()
            end_s = t0 + seconds
            await asyncio.gather(
                sample_rss(pid, t0, end_s, samples),
                *(slot(http, url, seed * 100 + i, rate, end_s, totals, gate) for i in range(calls)),
            )
            soak_s = time.monotonic() - t0
        async with aiohttp.ClientSession() as http:  # a fresh one: the soak's keep-alive sockets are gone
            drain_s = await wait_no_calls(http, url, 60.0)
            steps = await engine_steps(http, url)
        await asyncio.sleep(3.0)
        end, end_kinds = threads_and_fds(pid), thread_and_fd_kinds(pid)
        rss_end = rss_mb(pid)
    growth = rss_growth(samples, warmup_frac * seconds)
    ttfa = summary(totals.ttfa_ms) if totals.ttfa_ms else {}
    row = {
        "minutes": round(soak_s / 60.0, 1),
        "calls (vanished)": f"{totals.calls} ({totals.vanished})",
        "utterances": totals.utterances,
        "interrupts": totals.interrupts,
        "underrun frames": totals.underrun_frames,
        "calls w/ underruns": totals.underrun_calls,
        "ttfa p50/p95 ms": f"{ttfa.get('p50', 0):.0f}/{ttfa.get('p95', 0):.0f}",
        "RSS growth %": growth["growth_pct"],
        "threads": f"{baseline[0]} -> {end[0]}",
        "fds": f"{baseline[1]} -> {end[1]}",
    }
    print(table([row], list(row)))  # noqa: T201 - benchmark output
    extra = {
        "errors": totals.errors,
        "failures": totals.failures[:20],
        "rss_mb": {"baseline": rss_baseline, "end": rss_end, **growth},
        "longest_step_ms": steps["longest_ms"],
        "longest_step_cpu_ms": steps["longest_cpu_ms"],
        "steps_over_budget": steps["over_budget"],
        "drain_s": drain_s,
        "loadavg": os.getloadavg(),
    }
    print(extra)  # noqa: T201
    record: dict[str, Any] = {
        "minutes": minutes,
        "calls": calls,
        "seed": seed,
        "pathological_rate": rate,
        "soak_s": soak_s,
        "summary": row,
        **extra,
        "ttfa_ms": ttfa,
        "frames_sent": totals.frames_sent,
        "threads": {"baseline": baseline[0], "end": end[0]},
        "fds": {"baseline": baseline[1], "end": end[1]},
        "kinds": {"baseline": baseline_kinds, "end": end_kinds},
        "rss_samples": samples,
    }
    print("wrote", write_json("soak", record))  # noqa: T201


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pathological-rate", type=float, default=0.05, help="share of issue 11's texts")
    parser.add_argument("--warmup-frac", type=float, default=0.2, help="share of the run that is warm-up")
    args = parser.parse_args()
    asyncio.run(main(args.minutes, args.calls, args.seed, args.pathological_rate, args.warmup_frac))
