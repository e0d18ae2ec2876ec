"""Silent two-way calls from real Chromium: server CPU per call and packets each way, DTX on and off.

    .venv/bin/python -m bench.browser_cpu [--calls 1 2] [--seconds 10] [--runs 3]

`voicertc serve` (Piper, loopback-only ICE, `[webrtc] dtx` on or off) runs as a child process; one
headless Debian Chromium opens `--calls` pages of the bundled web client, each a two-way call whose
fake microphone plays a WAV of digital silence (what a muted or quiet mic gives after Chromium's
processing), with the agent silent. Per run: the server process's CPU (all threads, /proc) over
`--seconds`, divided by the calls; Chromium's `getStats()` packets per second, mic (sent) and agent
(received), and the agent stream's concealed samples (0 when NetEq takes the silence as DTX). Unlike
`bench.listen_latency`'s aiortc callers (aiortc's encoder has no DTX), Chromium honours the answer's
`usedtx=1`, as a browser caller does. p50/p95 printed; JSON in bench/results/browser_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

from bench.peer import CHROMIUM, CHROMIUM_ARGS, process_cpu_s, served
from bench.report import summary, table, write_json

STATS_JS = """(async () => {
  const out = {sent: 0, received: 0, concealed: 0};
  (await voicertc.state.pc.getStats()).forEach((s) => {
    if (s.kind !== 'audio') return;
    if (s.type === 'outbound-rtp') out.sent = s.packetsSent;
    if (s.type === 'inbound-rtp') { out.received = s.packetsReceived; out.concealed = s.concealedSamples; }
  });
  return out;
})()"""


def silent_wav(seconds: float = 1.0) -> Path:
    path = Path(tempfile.mkdtemp()) / "silence.wav"
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(b"\0\0" * int(16000 * seconds))
    return path


def config_toml(dtx: bool) -> str:
    return (
        f"[server]\nport = 0\n[webrtc]\nloopback_only = true\ndtx = {str(dtx).lower()}\n"
        '[engine]\nbackend = "piper"\n[logging]\nlevel = "WARNING"\n'
    )


async def open_call(context: Any, url: str) -> Any:
    page = await context.new_page()
    await page.goto(url)
    await page.check("#mic")
    await page.click("#call")
    await page.wait_for_function(
        "voicertc.connectionState() === 'connected' && voicertc.channelOpen()", timeout=30000
    )
    return page


def packets_per_s(before: list[dict], after: list[dict], key: str, seconds: float) -> float:
    """Packets per second counted by `key` over every page's `getStats()` between two readings."""
    return sum(a[key] - b[key] for a, b in zip(after, before, strict=True)) / seconds


async def measure(dtx: bool, calls: int, seconds: float, runs: int) -> list[dict[str, Any]]:
    """`runs` windows of `seconds` with `calls` silent two-way Chromium calls on one server."""
    from playwright.async_api import async_playwright

    args = [
        *CHROMIUM_ARGS,
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={silent_wav()}%noloop",
    ]
    rows = []
    with served(config_toml(dtx)) as (url, pid):
        async with async_playwright() as playwright:
            context = await playwright.chromium.launch_persistent_context(
                tempfile.mkdtemp(), executable_path=CHROMIUM, headless=True, args=args
            )
            try:
                pages = [await open_call(context, url) for _ in range(calls)]
                await asyncio.sleep(3.0)  # settle: DTLS, the hangover before DTX, model warm-up
                for run in range(runs):
                    before = [await page.evaluate(STATS_JS) for page in pages]
                    cpu0, t0 = process_cpu_s(pid), time.monotonic()
                    await asyncio.sleep(seconds)
                    cpu1, t1 = process_cpu_s(pid), time.monotonic()
                    after = [await page.evaluate(STATS_JS) for page in pages]
                    elapsed = t1 - t0

                    row = {
                        "dtx": dtx,
                        "calls": calls,
                        "run": run,
                        "cpu_%_per_call": 100.0 * (cpu1 - cpu0) / elapsed / calls,
                        "mic_pkts_per_s": packets_per_s(before, after, "sent", elapsed) / calls,
                        "agent_pkts_per_s": packets_per_s(before, after, "received", elapsed) / calls,
                        "agent_concealed_samples": sum(a["concealed"] for a in after),
                    }
                    print(f"  {row}", flush=True)
                    rows.append(row)
            finally:
                await context.close()
    return rows


async def main_async(args: argparse.Namespace) -> None:
    rows: list[dict[str, Any]] = []
    for dtx in (True, False):
        for calls in args.calls:
            rows += await measure(dtx, calls, args.seconds, args.runs)
    result_rows = []
    for dtx in (True, False):
        for calls in args.calls:
            mine = [r for r in rows if r["dtx"] == dtx and r["calls"] == calls]
            for metric in ("cpu_%_per_call", "mic_pkts_per_s", "agent_pkts_per_s"):
                result_rows.append(
                    {"dtx": dtx, "calls": calls, "metric": metric, **summary([r[metric] for r in mine])}
                )
    load = os.getloadavg()
    print(f"\nload average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} ({os.cpu_count()} CPUs, shared)")
    print(table(result_rows, ["dtx", "calls", "metric", "n", "p50", "p95", "min", "max"]))
    path = write_json("browser_cpu", {"args": vars(args), "runs": rows, "summary": result_rows})
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
