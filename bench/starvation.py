"""One call's pathological text must not starve another (issue 11, findings 1 and 2; issue 24, item 2).

    .venv/bin/python -m bench.starvation [--runs 3] [--utterances 8] [--workers 1] [--piece-phonemes 0]
    .venv/bin/python -m bench.starvation --model cosyvoice2 [--model-dir DIR] [--speed 0.9] [--text-workers 1]

The bundled Piper voice by default; `--model cosyvoice2` serves a CosyVoice2 directory (default: the tiny
one, built into a temporary directory by `bench.make_tiny_model_dir`), B speaks its texts at `--speed`, and
two long texts of issue 24 join the pathological ones: 20,000 digits and 15,000 characters of prose.
`--text-workers 0` puts text normalisation back on the engine thread (the behaviour before issue 24).

`voicertc serve` (Piper, loopback-only ICE) runs as a child process, so its RSS and CPU are its own;
this process holds two aiortc client peers (bench/peer.py). Per run:
- quiet: call A speaks `--utterances` sentences back to back, alone;
- for each pathological text: A starts a sentence; as soon as it is heard (`speech.started`), call B
  sends the text; A then speaks `--utterances` more sentences back to back while B's text plays;
  then B is interrupted.
Measured:
- A's time to first audio per utterance (the server's `speech.started` ttfa_ms: from when the
  utterance could play to its first frame), p50/p95, quiet vs under each text;
- underrun frames (silence sent mid-utterance) of A and of B (`GET /v1/calls/{id}` deltas);
- engine steps: the longest so far (wall time, and the engine thread's CPU time, which other
  processes on a shared machine cannot inflate) and how many passed `engine.max_step_ms` (`/metrics`);
- server RSS (/proc/<pid>/statm) before B's text and 1 s after B was interrupted;
- the longest `/healthz` answer while B's text is processed (polled every 50 ms): the event loop's
  longest freeze, give or take one poll.
Targets: A's TTFA p95 <= 2x quiet, 0 underruns, longest step <= max_step_ms, RSS growth <= 50 MB.
Prints a table; writes bench/results/starvation.json. The machine's load average is in the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

import aiohttp

from bench.call_load import SENTENCES, wait_terminal
from bench.peer import PIPER_CONFIG_TOML, HttpPeer, served
from bench.report import summary, table, write_json
from voicertc.webrtc.loopback import patch_aioice_loopback

PATHOLOGICAL = {
    "digits": "123456789012 " * 16,
    "currency": "$1,234,567.89 €9,876,543.21 £5,555,555.55 ¥123,456,789 " * 4,
    "math": "𝐀𝐁𝐂𝐃𝐄𝐅 𝑥𝑦𝑧 𝔸𝔹ℂ 𝕒𝕓𝕔 " * 10,
    "emoji": "Hello 😀 world 🎉 this 🚀 is 👍 fun 🔥 " * 6,
}
LONG = {  # issue 24: what froze the CosyVoice2 server (wetext on the engine thread, under the GIL)
    "digits_20k": "1234567890" * 2000,
    "prose_15k": ("The quick brown fox jumps over the lazy dog while the band plays on. " * 220)[:15000],
}
MB = 1024 * 1024
WAIT_S = 300.0  # one utterance heard, at most (the tiny CosyVoice2 on a loaded 2-core VM is slow)


def rss_mb(pid: int) -> float:
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / MB


def children_rss_mb(pid: int) -> float:
    """RSS of the server's child processes (CosyVoice2's text processes), MB."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                total += rss_mb(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue  # a process that ended meanwhile
    return total


async def engine_steps(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The engine's step counters from /metrics: steps, longest_ms, over_budget."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()

    def value(name: str) -> float:
        match = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(match.group(1)) if match else float("nan")

    return {
        "steps": value("voicertc_engine_step_seconds_count"),
        "longest_ms": 1000.0 * value("voicertc_engine_step_max_seconds"),
        "longest_cpu_ms": 1000.0 * value("voicertc_engine_step_max_cpu_seconds"),
        "over_budget": value("voicertc_engine_steps_over_budget_total"),
    }


async def underruns(peer: HttpPeer) -> int:
    return int((await peer.info())["underrun_frames"])


async def speak_and_wait(peer: HttpPeer, text: str) -> dict[str, Any]:
    """Speak `text`, wait until it played; its `speech.started` event (or an error event)."""
    utterance_id = await peer.speak(text)
    end = await wait_terminal(peer, utterance_id, timeout_s=WAIT_S)
    if end["type"] != "speech.done":
        return end
    return next(e for e in peer.events if e["type"] == "speech.started" and e["utterance_id"] == utterance_id)


async def a_speaks(peer: HttpPeer, texts: Any, count: int) -> list[float]:
    ttfa: list[float] = []
    for _ in range(count):
        event = await speak_and_wait(peer, next(texts))
        if event["type"] == "speech.started":
            ttfa.append(float(event["ttfa_ms"]))
    return ttfa


async def healthz_longest(http: aiohttp.ClientSession, url: str, longest: list[float]) -> None:
    """Poll /healthz every 50 ms until cancelled; `longest[0]` = the slowest answer so far (ms)."""
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        async with http.get(f"{url}/healthz") as resp:
            await resp.read()
        longest[0] = max(longest[0], 1000.0 * (loop.time() - started))
        await asyncio.sleep(0.05)


async def under_text(
    http: aiohttp.ClientSession,
    url: str,
    pid: int,
    a: HttpPeer,
    b: HttpPeer,
    text: str,
    count: int,
    speed: float = 1.0,
) -> dict[str, Any]:
    texts = itertools.cycle(SENTENCES)
    rss_before, steps_before = rss_mb(pid), await engine_steps(http, url)
    a_under0, b_under0 = await underruns(a), await underruns(b)
    first_id = await a.speak(next(texts))  # A is already speaking when B's text arrives
    first_started = await a.wait_event("speech.started", first_id, timeout_s=WAIT_S)
    healthz = [0.0]
    probe = asyncio.create_task(healthz_longest(http, url, healthz))
    try:
        b_id = await (b.speak(text, speed=speed) if speed != 1.0 else b.speak(text))
        await wait_terminal(a, first_id, timeout_s=WAIT_S)
        ttfa = [float(first_started["ttfa_ms"])] + await a_speaks(a, texts, count)
    finally:
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)
    b_started = any(e["type"] == "speech.started" and e["utterance_id"] == b_id for e in b.events)
    cut = await b.interrupt()
    await asyncio.sleep(1.0)
    steps_after = await engine_steps(http, url)
    return {
        "healthz_max_ms": healthz[0],
        "a_ttfa_ms": ttfa,
        "a_underrun_frames": await underruns(a) - a_under0,
        "b_underrun_frames": await underruns(b) - b_under0,
        "b_started": b_started,
        "b_played_ms": float(cut.get("played_ms") or 0.0),
        "steps": steps_after["steps"] - steps_before["steps"],
        "over_budget_steps": steps_after["over_budget"] - steps_before["over_budget"],
        "longest_step_ms_so_far": steps_after["longest_ms"],
        "rss_before_mb": rss_before,
        "rss_after_mb": rss_mb(pid),
    }


async def one_run(
    url: str, pid: int, count: int, pathological: dict[str, str], speed: float = 1.0
) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        a, b = HttpPeer(http, url), HttpPeer(http, url)
        try:
            await asyncio.gather(a.connect(), b.connect())
            await asyncio.sleep(1.0)
            await speak_and_wait(a, "Warm up.")
            await speak_and_wait(b, "Warm up.")
            under0 = await underruns(a)
            quiet = await a_speaks(a, itertools.cycle(SENTENCES), count)
            result: dict[str, Any] = {
                "quiet": {"a_ttfa_ms": quiet, "a_underrun_frames": await underruns(a) - under0},
                "texts": {},
            }
            for name, text in pathological.items():
                result["texts"][name] = await under_text(http, url, pid, a, b, text, count, speed)
            result["engine_steps"] = await engine_steps(http, url)
            return result
        finally:
            await asyncio.gather(a.close(), b.close(), return_exceptions=True)


def rows(
    runs: list[dict[str, Any]], max_step_ms: int, pathological: dict[str, str]
) -> tuple[list[dict[str, object]], dict[str, Any]]:
    quiet = summary([t for r in runs for t in r["quiet"]["a_ttfa_ms"]])
    out: list[dict[str, object]] = [
        {
            "B sends": "(nothing: quiet)",
            "A ttfa p50 ms": quiet["p50"],
            "A ttfa p95 ms": quiet["p95"],
            "p95 / quiet": 1.0,
            "A underruns": sum(r["quiet"]["a_underrun_frames"] for r in runs),
        }
    ]
    record: dict[str, Any] = {"quiet_ttfa_ms": quiet, "texts": {}}
    for name in pathological:
        parts = [r["texts"][name] for r in runs]
        ttfa = summary([t for p in parts for t in p["a_ttfa_ms"]])
        growth = [p["rss_after_mb"] - p["rss_before_mb"] for p in parts]
        agg = {
            "a_ttfa_ms": ttfa,
            "a_underrun_frames": sum(p["a_underrun_frames"] for p in parts),
            "b_underrun_frames": sum(p["b_underrun_frames"] for p in parts),
            "over_budget_steps": sum(p["over_budget_steps"] for p in parts),
            "steps": sum(p["steps"] for p in parts),
            "rss_growth_mb_max": max(growth),
            "healthz_max_ms": max(p["healthz_max_ms"] for p in parts),
        }
        record["texts"][name] = agg
        out.append(
            {
                "B sends": name,
                "A ttfa p50 ms": ttfa["p50"],
                "A ttfa p95 ms": ttfa["p95"],
                "p95 / quiet": ttfa["p95"] / quiet["p95"],
                "A underruns": agg["a_underrun_frames"],
                "B underruns": agg["b_underrun_frames"],
                f"steps > {max_step_ms} ms": f"{agg['over_budget_steps']:.0f}/{agg['steps']:.0f}",
                "RSS growth MB (max)": agg["rss_growth_mb_max"],
                "/healthz max ms": agg["healthz_max_ms"],
            }
        )
    return out, record


def server_config(args: argparse.Namespace, model_dir: str) -> str:
    """The served config.toml: Piper, or CosyVoice2 from `model_dir`."""
    engine = f"workers = {args.workers}\nmax_step_ms = {args.max_step_ms}\n"
    if args.model == "cosyvoice2":
        engine += f'model_dir = "{model_dir}"\ntext_workers = {args.text_workers}\n'
        backend = 'backend = "cosyvoice2"\n'
    else:
        engine += f"piper_piece_phonemes = {args.piece_phonemes}\n"
        backend = 'backend = "piper"\n'
    return PIPER_CONFIG_TOML.replace('backend = "piper"\n', backend + engine).replace(
        'level = "WARNING"', 'level = "INFO"'
    )


async def main(args: argparse.Namespace) -> None:
    patch_aioice_loopback()
    runs, count, max_step_ms = args.runs, args.utterances, args.max_step_ms
    pathological = dict(PATHOLOGICAL)
    model_dir = args.model_dir
    if args.model == "cosyvoice2":
        pathological.update(LONG)
        if not model_dir:
            from bench.make_tiny_model_dir import make_tiny_model_dir

            model_dir = str(make_tiny_model_dir(Path(tempfile.mkdtemp(prefix="cv2-tiny-"))))
    if args.only:
        pathological = {k: v for k, v in pathological.items() if k in args.only.split(",")}
    config = server_config(args, model_dir)
    log: deque[str] = deque(maxlen=2000)
    results = []
    with served(config, log_lines=log) as (url, pid):
        rss_start = rss_mb(pid)
        for _ in range(runs):
            results.append(await one_run(url, pid, count, pathological, args.speed))
        rss_end = rss_mb(pid)
        children_end = children_rss_mb(pid)
        steps = results[-1]["engine_steps"]
    pieces = [m.group(1) for line in log if (m := re.search(r"pieces of at most (\d+) phonemes", line))]
    over_by_stage: dict[str, list[float]] = {}  # the engine logs an utterance's first over-budget step
    for line in log:
        if m := re.search(r"an engine step took (\d+) ms \((\w+);", line):
            over_by_stage.setdefault(m.group(2), []).append(float(m.group(1)))
    table_rows, record = rows(results, max_step_ms, pathological)
    print(table(table_rows, list(table_rows[1])))  # noqa: T201 - benchmark output
    summary_line = {
        "piece_phonemes": pieces[0] if pieces else "?",
        "longest_step_ms": round(steps["longest_ms"], 1),
        "longest_step_cpu_ms": round(steps["longest_cpu_ms"], 1),
        "steps_over_budget": f"{steps['over_budget']:.0f}/{steps['steps']:.0f}",
        "server_rss_mb": f"{rss_start:.0f} -> {rss_end:.0f}",
        "children_rss_mb": round(children_end),
        "over_budget_by_stage": {k: f"{len(v)} x, max {max(v):.0f} ms" for k, v in over_by_stage.items()},
        "loadavg": os.getloadavg(),
    }
    print(summary_line)  # noqa: T201
    path = write_json(
        args.out,
        {
            "model": args.model,
            "speed": args.speed,
            "text_workers": args.text_workers,
            "runs": runs,
            "utterances_per_phase": count,
            "workers": args.workers,
            "max_step_ms": max_step_ms,
            "piece_phonemes": summary_line["piece_phonemes"],
            "longest_step_ms": steps["longest_ms"],
            "longest_step_cpu_ms": steps["longest_cpu_ms"],
            "engine_steps": steps,
            "over_budget_ms_by_stage": over_by_stage,
            "server_rss_mb": {"start": rss_start, "end": rss_end, "children_end": children_end},
            "summary": record,
            "raw": results,
        },
    )
    print("wrote", path)  # noqa: T201


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--utterances", type=int, default=8, help="A's sentences per phase")
    parser.add_argument("--workers", type=int, default=1, help="engine.workers of the server")
    parser.add_argument("--piece-phonemes", type=int, default=0, help="engine.piper_piece_phonemes, 0 = auto")
    parser.add_argument("--max-step-ms", type=int, default=200, help="engine.max_step_ms")
    parser.add_argument("--model", choices=("piper", "cosyvoice2"), default="piper")
    parser.add_argument("--model-dir", default="", help="cosyvoice2 directory ('' = the tiny one)")
    parser.add_argument("--speed", type=float, default=1.0, help="B's speak speed (cosyvoice2)")
    parser.add_argument("--text-workers", type=int, default=1, help="engine.text_workers (cosyvoice2)")
    parser.add_argument("--out", default="starvation", help="results file name under bench/results/")
    parser.add_argument("--only", default="", help="comma-separated text names to run (default: all)")
    asyncio.run(main(parser.parse_args()))
