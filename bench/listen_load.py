"""N two-way callers beside 2 speakers: CPU per call, the speakers' gaps, transcript lag, dropped transcripts.

    .venv/bin/python -m bench.listen_load [--callers 1 3 6] [--runs 2] [--seconds 20] [--whisper-workers 0]

One fresh `voicertc serve` (Piper, `[listen]` on, transcripts on) per N and run. Two speaker calls
(recvonly, no mic) keep long utterances queued the whole time; N caller calls send a looped spoken
question with pauses (a segment every ~3 s). Over a `--seconds` window it reports:
- server CPU (all threads, % of one core), in total and per call (N + 2 calls);
- the speakers' playout as the server counts it (`GET /v1/calls/{id}` deltas over the window:
  `gaps_over_100ms`, `late_frames`, `underrun_frames`) and as their client sees it (pauses over 100 ms
  between received frames);
- transcript lag: a `user.transcript`'s arrival minus the moment its segment's end left the caller's
  mic (`end_ms` on the call's clock, which starts at the mic's first frame);
- segments (`user.speech.stopped`), transcripts, transcripts dropped (`"dropped": true`) and segments
  left untranscribed 3 s after the window;
- server CPU in the 5 s after the callers hung up (Whisper must not keep working for ended calls).
Client peers run in this process and share the machine's cores with the server.
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
from aiortc.mediastreams import MediaStreamError

from bench.listen_latency import MicPeer
from bench.mic import ClipTrack, caller_clip
from bench.peer import HttpPeer, process_cpu_s, served
from bench.report import machine, summary, table, write_json
from voicertc.webrtc.loopback import patch_aioice_loopback

QUESTION = "Could you tell me when the next train to the airport leaves?"
SPEAKER_TEXT = (
    "Here is the news for this morning. The weather stays dry and mild, with a light wind from the west. "
    "Trains are running on time on every line, and the airport reports no delays. "
) * 3
GAP_S = 0.1


def config_toml(whisper_workers: int) -> str:
    return (
        '[server]\nport = 0\n[webrtc]\nloopback_only = true\n[engine]\nbackend = "piper"\n'
        f'[listen]\nbarge_in = "off"\nwhisper_workers = {whisper_workers}\n'
        '[limits]\nmax_pending_calls = 16\nmax_pending_total = 16\n[logging]\nlevel = "WARNING"\n'
    )


class Speaker(HttpPeer):
    """A speaking call's client: records pauses over 100 ms between received frames in the window."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str) -> None:
        super().__init__(http, base_url)
        self.window: tuple[float, float] | None = None
        self.client_gaps = 0
        self._last_s: float | None = None

    async def _drain(self, track: Any) -> None:
        last_pts: int | None = None
        with contextlib.suppress(MediaStreamError, asyncio.CancelledError):
            while True:
                frame = await track.recv()
                now = time.monotonic()
                inside = self.window is not None and self.window[0] <= now <= self.window[1]
                # a DTX pause ([webrtc] dtx) is silence the sender skipped: its timestamps jump as far
                # as the clock, so only the pause beyond that jump is a gap
                skipped_s = 0.0
                if last_pts is not None and frame.pts is not None:
                    skipped_s = max(0.0, (frame.pts - last_pts - frame.samples) / frame.sample_rate)
                if inside and self._last_s is not None and now - self._last_s - skipped_s > GAP_S:
                    self.client_gaps += 1
                self._last_s, last_pts = now, frame.pts
                self.frames_received += 1


async def keep_speaking(speaker: Speaker, stop: asyncio.Event) -> None:
    """Keep two long utterances queued until `stop`."""
    queued: list[str] = []
    while not stop.is_set():
        queued = [
            u
            for u in queued
            if not any(e.get("utterance_id") == u and e["type"] == "speech.done" for e in speaker.events)
        ]
        while len(queued) < 2:
            queued.append(await speaker.speak(SPEAKER_TEXT))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


def transcript_stats(caller: MicPeer, window: tuple[float, float]) -> dict[str, Any]:
    assert caller.mic.started_s is not None
    lags, dropped, segments, texts = [], 0, 0, 0
    for t, event in caller.events:
        if event["type"] == "user.speech.stopped":  # at_ms: the segment's end on the call's clock
            segments += window[0] <= caller.mic.started_s + event["at_ms"] / 1000.0 <= window[1]
        if event["type"] != "user.transcript":
            continue
        ended_s = caller.mic.started_s + event["end_ms"] / 1000.0
        if not window[0] <= ended_s <= window[1]:
            continue
        if event.get("dropped"):
            dropped += 1
        else:
            texts += 1
            lags.append(t - ended_s)
    return {"lags": lags, "dropped": dropped, "segments": segments, "transcripts": texts}


async def one_run(callers: int, seconds: float, whisper_workers: int, pcm: np.ndarray) -> dict[str, Any]:
    with served(config_toml(whisper_workers)) as (url, pid):
        async with aiohttp.ClientSession() as http:
            speakers = [Speaker(http, url) for _ in range(2)]
            mics = [MicPeer(http, url, ClipTrack(pcm, loop_clip=True)) for _ in range(callers)]
            for peer in [*speakers, *mics]:
                await peer.connect()
            stop = asyncio.Event()
            talkers = [asyncio.ensure_future(keep_speaking(s, stop)) for s in speakers]
            try:
                await asyncio.sleep(3.0)  # settle: first utterances playing, first segments heard
                before = [await s.info() for s in speakers]
                window = (time.monotonic(), time.monotonic() + seconds)
                for s in speakers:
                    s.window = window
                cpu0, t0 = process_cpu_s(pid), time.monotonic()
                await asyncio.sleep(seconds)
                cpu1, t1 = process_cpu_s(pid), time.monotonic()
                after = [await s.info() for s in speakers]
                await asyncio.sleep(3.0)  # transcripts of segments that ended in the window
                stats = [transcript_stats(m, window) for m in mics]
                for m in mics:
                    await m.close()
                cpu2, t2 = process_cpu_s(pid), time.monotonic()
                await asyncio.sleep(5.0)
                cpu3, t3 = process_cpu_s(pid), time.monotonic()
            finally:
                stop.set()
                await asyncio.gather(*talkers, return_exceptions=True)
                for s in speakers:
                    await s.close()
    cpu_pct = 100.0 * (cpu1 - cpu0) / (t1 - t0)

    def delta(key: str) -> int:
        return sum(a[key] - b[key] for a, b in zip(after, before, strict=True))

    lags = [lag for s in stats for lag in s["lags"]]
    segments = sum(s["segments"] for s in stats)
    transcripts = sum(s["transcripts"] for s in stats)
    dropped = sum(s["dropped"] for s in stats)
    return {
        "callers": callers,
        "cpu_total_%": cpu_pct,
        "cpu_per_call_%": cpu_pct / (callers + 2),
        "speaker_gaps_server": delta("gaps_over_100ms"),
        "speaker_late_frames": delta("late_frames"),
        "speaker_underrun_frames": delta("underrun_frames"),
        "speaker_gaps_client": sum(s.client_gaps for s in speakers),
        "transcript_lag_p50_s": float(np.percentile(lags, 50)) if lags else None,
        "transcript_lag_max_s": max(lags) if lags else None,
        "segments": segments,
        "transcripts": transcripts,
        "dropped": dropped,
        "untranscribed": max(0, segments - transcripts - dropped),
        "cpu_after_hangup_%": 100.0 * (cpu3 - cpu2) / (t3 - t2),
    }


async def main_async(args: argparse.Namespace) -> None:
    restore = patch_aioice_loopback()
    pcm, _ = caller_clip([QUESTION, 1.2])
    rows: list[dict[str, Any]] = []
    try:
        for run in range(args.runs):
            for n in args.callers:
                row = await one_run(n, args.seconds, args.whisper_workers, pcm)
                row["run"] = run
                print(f"  run {run} N={n}: {row}", flush=True)
                rows.append(row)
    finally:
        restore()
    metrics = [k for k in rows[0] if k not in ("callers", "run")]
    result_rows = []
    for n in args.callers:
        for metric in metrics:
            values = [r[metric] for r in rows if r["callers"] == n and r[metric] is not None]
            if values:
                result_rows.append({"callers": n, "metric": metric, **summary(values)})
    load = os.getloadavg()
    print(f"\nload average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} ({os.cpu_count()} CPUs, shared)")
    print(table(result_rows, ["callers", "metric", "n", "p50", "p95", "min", "max"]))
    path = write_json(
        "listen_load", {"args": vars(args), "machine": machine(), "runs": rows, "summary": result_rows}
    )
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 3, 6])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--whisper-workers", type=int, default=0)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
