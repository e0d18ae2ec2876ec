"""Speak -> first audible sample in headless Chromium, bundled Piper voice, measured in the page's clock.

    .venv/bin/python -m bench.browser_latency [--runs 25]

`voicertc serve` (Piper, loopback-only ICE) runs as a child process; Playwright drives Debian's
/usr/bin/chromium (never a downloaded browser) on the bundled page (web/), which calls the server.
Each run: idle a random 0.2-0.5 s, then in the page `voicertc.speak(text)` (data channel `speak`),
let the utterance play 0.3 s after it is heard, `voicertc.interrupt()`, wait for `speech.interrupted`.

Measurement (page clock, `performance.now()`): t0 right before `voicertc.speak`. The page's 16 kHz
WebAudio capture (a ScriptProcessor of 256 samples fed by the received MediaStream, after Chrome's
jitter buffer and Opus decoder) is redirected to a recorder that timestamps each buffer as the page
receives it; the run's time is that of the first buffer holding a sample with |x| > 0.01 (-40 dBFS):
- `audible_ms`: when the page's JavaScript got the buffer (what the page could act on; primary).
- `audible_sample_ms`: the same, back-dated by the samples after the hit (16 ms at most earlier).
- `page_ttfa_ms`: the page's own stat (first 256-sample buffer with RMS > 0.01), for comparison.
- `server_ttfa_ms`: the server's `speech.started` ttfa (Call.speak -> first frame to the sender).
Prints a table; writes bench/results/browser_latency_trim<ms>.json (`--trim-ms 0`: leading silence sent).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from typing import Any

from bench.peer import CHROMIUM, CHROMIUM_ARGS, PIPER_CONFIG_TOML, served
from bench.report import summary, table, write_json

TEXTS = {
    "short (4 words)": "Hello, how are you?",
    "medium (10 words)": "I can help you book a table for dinner tonight.",
}
AUDIBLE = 0.01  # |sample| above this counts as heard (-40 dBFS)
PLAY_S = 0.3
CAPTURE_RATE_HZ = 16000

# The recorder replaces the page's capture list: `onPcm` pushes every 16 kHz buffer into it.
RECORDER_JS = """
window.__bench = {
  start(text, threshold) {
    const b = window.__bench;
    b.hit = null;
    b.events = voicertc.state.events.length;
    voicertc.state.lastTtfaMs = null;
    voicertc.state.capture = {
      push(chunk) {
        const now = performance.now();
        if (b.hit !== null) return;
        for (let i = 0; i < chunk.length; i++) {
          if (Math.abs(chunk[i]) > threshold) {
            b.hit = { t: now, index: i, length: chunk.length };
            return;
          }
        }
      },
    };
    b.t0 = performance.now();
    voicertc.speak(text);
    return b.t0;
  },
  startedEvent() {
    return voicertc.state.events.slice(window.__bench.events).find((e) => e.type === "speech.started");
  },
};
"""


async def one_run(page: Any, text: str) -> dict[str, float]:
    await asyncio.sleep(random.uniform(0.2, 0.5))
    t0 = await page.evaluate("([t, thr]) => __bench.start(t, thr)", [text, AUDIBLE])
    await page.wait_for_function(
        "__bench.hit !== null && voicertc.state.lastTtfaMs !== null && __bench.startedEvent()", timeout=10_000
    )
    hit = await page.evaluate("__bench.hit")
    page_ttfa_ms = await page.evaluate("voicertc.state.lastTtfaMs")
    started = await page.evaluate("__bench.startedEvent()")
    await asyncio.sleep(PLAY_S)
    await page.evaluate("voicertc.interrupt()")
    uid = started["utterance_id"]
    await page.wait_for_function(
        f"voicertc.state.events.some(e => e.type === 'speech.interrupted' && e.utterance_id === '{uid}')",
        timeout=10_000,
    )
    await page.evaluate("voicertc.state.capture = null")
    late_samples = hit["length"] - hit["index"]
    return {
        "audible_ms": hit["t"] - t0,
        "audible_sample_ms": hit["t"] - t0 - 1000.0 * late_samples / CAPTURE_RATE_HZ,
        "page_ttfa_ms": float(page_ttfa_ms),
        "server_ttfa_ms": float(started["ttfa_ms"]),
    }


async def open_call(context: Any, url: str) -> Any:
    page = await context.new_page()
    await page.goto(url)
    await page.click("#call")
    await page.wait_for_function(
        "voicertc.connectionState() === 'connected' && voicertc.channelOpen()", timeout=20_000
    )
    await page.evaluate(RECORDER_JS)
    return page


def _row(label: str, runs: int, stats: dict[str, dict[str, float]]) -> dict[str, object]:
    return {
        "sentence": label,
        "runs": runs,
        "audible p50 ms": stats["audible_ms"]["p50"],
        "audible p95 ms": stats["audible_ms"]["p95"],
        "sample p50 ms": stats["audible_sample_ms"]["p50"],
        "page stat p50 ms": stats["page_ttfa_ms"]["p50"],
        "server ttfa p50 ms": stats["server_ttfa_ms"]["p50"],
        "server ttfa p95 ms": stats["server_ttfa_ms"]["p95"],
    }


async def main(runs: int, trim_ms: int) -> None:
    from playwright.async_api import async_playwright

    config = PIPER_CONFIG_TOML.replace("[webrtc]\n", f"[webrtc]\ntrim_leading_silence_ms = {trim_ms}\n")
    with served(config) as (url, _pid):
        async with async_playwright() as p:
            context = await p.chromium.launch_persistent_context(
                tempfile.mkdtemp(), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
            )
            try:
                page = await open_call(context, url)
                await one_run(page, "Warm up.")
                rows, record = [], {}
                for label, text in TEXTS.items():
                    samples = [await one_run(page, text) for _ in range(runs)]
                    stats = {k: summary([s[k] for s in samples]) for k in samples[0]}
                    record[label] = {"text": text, **stats}
                    rows.append(_row(label, runs, stats))
                await page.click("#hangup")
            finally:
                await context.close()
    print(table(rows, list(rows[0])))  # noqa: T201 - benchmark output
    record = {"runs": runs, "trim_ms": trim_ms, "audible_threshold": AUDIBLE, "results": record}
    path = write_json(f"browser_latency_trim{trim_ms}", record)
    print("wrote", path)  # noqa: T201


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=25)
    parser.add_argument("--trim-ms", type=int, default=100, help="webrtc.trim_leading_silence_ms (0 = off)")
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.trim_ms))
