"""Two-way calls: VAD onset latency, barge-in latency ("speech" and "words"), CPU per listening call.

    .venv/bin/python -m bench.listen_latency [--trials 5] [--calls 2] [--cpu-seconds 10] [--cpu-runs 2]

`voicertc serve` (Piper, loopback-only ICE) runs as a child process; this process holds aiortc peers
whose microphone is a `bench.mic.ClipTrack` playing a Piper-synthesized caller clip (2.5 s silence, a
question, 1.5 s silence) and that know when each clip sample left (`ClipTrack.sent_at`).

- VAD onset latency: the question's onset leaving the caller -> `user.speech.started` arriving on the
  caller's data channel (includes `[listen] min_speech_ms` = 200 ms by design, aiortc's 80 ms inbound
  jitter buffer and Silero's 32 ms windows). Also the error of the reported `at_ms` against the clip.
- Barge-in latency: the agent speaks a long reply; the caller's onset leaving -> the last loud (> -40 dBFS)
  frame the caller receives. Measured at an aiortc client (its jitter buffer, 80 ms, is in the number; a
  browser's NetEq is typically 20-60 ms). "words" waits for a Whisper partial with a non-backchannel word.
- CPU per call: server process CPU (all threads) per call-second with `--calls` calls for `--cpu-seconds`:
  send-only (recvonly offer), two-way with a silent mic, two-way with the mic speaking (the question
  looped) with transcripts off and on; the agent is silent in all four (so in DTX with `[webrtc] dtx`).
  aiortc's encoder has no DTX: these callers send all 50 mic frames a second even when silent, as a
  caller that ignores `usedtx=1` would; `bench.browser_cpu` measures Chromium callers, which honour it.
Several trials; p50/p95 printed with the load average; JSON in bench/results/listen_latency.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from typing import Any

import aiohttp
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from bench.mic import ClipTrack, caller_clip
from bench.peer import HttpPeer, process_cpu_s, served
from bench.report import summary, table, write_json
from voicertc.webrtc.loopback import patch_aioice_loopback

QUESTION = "What time does the museum open on Sunday?"
LONG_REPLY = (
    "Let me tell you about the museum. It has three floors of paintings, a sculpture garden, and a "
    "small cafe near the entrance. The first floor holds the modern collection. Guided tours start "
    "every hour, and they take about forty five minutes."
)
LOUD_RMS = 0.01


def config_toml(barge_in: str, transcribe: bool = True) -> str:
    return (
        '[server]\nport = 0\n[webrtc]\nloopback_only = true\n[engine]\nbackend = "piper"\n'
        f'[listen]\nbarge_in = "{barge_in}"\ntranscribe = {str(transcribe).lower()}\n'
        '[logging]\nlevel = "WARNING"\n'
    )


class MicPeer:
    """A caller with a clip microphone: events with arrival times, loud received frames' times."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str, mic: ClipTrack) -> None:
        self.http = http
        self.base_url = base_url
        self.mic = mic
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.pc.addTrack(mic)
        self.channel = self.pc.createDataChannel("events")
        self.channel.on("message", self._on_message)
        self.pc.on("track", self._on_track)
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.arrived = asyncio.Event()
        self.loud_s: list[float] = []
        self.call_id = ""
        self._reader: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        body = {"type": "offer", "sdp": self.pc.localDescription.sdp}
        async with self.http.post(f"{self.base_url}/v1/calls", json=body) as resp:
            answer = await resp.json()
        self.call_id = answer["id"]
        opened = asyncio.Event()
        self.channel.on("open", opened.set)
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
        if self.channel.readyState != "open":
            await asyncio.wait_for(opened.wait(), 20)

    async def speak(self, text: str) -> None:
        async with self.http.post(f"{self.base_url}/v1/calls/{self.call_id}/speak", json={"text": text}):
            pass

    def _on_message(self, message: str) -> None:
        self.events.append((time.monotonic(), json.loads(message)))
        self.arrived.set()

    def _on_track(self, track: Any) -> None:
        self._reader = asyncio.ensure_future(self._read(track))

    async def _read(self, track: Any) -> None:
        with contextlib.suppress(MediaStreamError, asyncio.CancelledError):
            while True:
                frame = await track.recv()
                pcm = frame.to_ndarray().astype(np.float32) / 32768.0
                if float(np.sqrt(np.mean(pcm**2))) > LOUD_RMS:
                    self.loud_s.append(time.monotonic())

    async def wait(self, kind: str, timeout_s: float) -> tuple[float, dict[str, Any]] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for t, event in self.events:
                if event["type"] == kind:
                    return t, event
            self.arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.arrived.wait(), max(0.01, deadline - time.monotonic()))
        return None

    async def close(self) -> None:
        with contextlib.suppress(aiohttp.ClientError):
            async with self.http.delete(f"{self.base_url}/v1/calls/{self.call_id}"):
                pass
        if self._reader is not None:
            self._reader.cancel()
        await self.pc.close()


async def barge_in_trial(http: aiohttp.ClientSession, url: str, pcm: np.ndarray, onset_s: float) -> dict:
    peer = MicPeer(http, url, ClipTrack(pcm))
    try:
        await peer.connect()
        await peer.speak(LONG_REPLY)
        started = await peer.wait("user.speech.started", 20)
        cut = await peer.wait("speech.interrupted", 20)
        playing = await peer.wait("speech.started", 0.1)
        await asyncio.sleep(1.0)  # the tail still in flight
        onset_sent = peer.mic.sent_at(onset_s)
        row: dict[str, Any] = {"agent_playing_at_onset": bool(playing and playing[0] < onset_sent)}
        if started is not None:
            row["vad_onset_ms"] = 1000 * (started[0] - onset_sent)
            row["at_ms_error"] = started[1]["at_ms"] - 1000 * onset_s
        if cut is not None and peer.loud_s:
            row["barge_in_ms"] = 1000 * (max(peer.loud_s) - onset_sent)
            row["heard_text_chars"] = len(cut[1].get("heard_text", ""))
        return row
    finally:
        await peer.close()


async def latency(mode: str, trials: int, pcm: np.ndarray, onset_s: float) -> list[dict]:
    rows = []
    with served(config_toml(mode)) as (url, _pid):
        async with aiohttp.ClientSession() as http:
            for i in range(trials):
                row = await barge_in_trial(http, url, pcm, onset_s)
                row.update(mode=mode, trial=i)
                print(f"  {mode} trial {i}: {row}", flush=True)
                rows.append(row)
    return rows


async def cpu_window(kind: str, calls: int, seconds: float, speech: np.ndarray) -> float:
    """Server CPU % of one core per call for `calls` calls of `kind` held open `seconds`."""
    with served(config_toml("speech", transcribe=kind != "mic speaking, no transcripts")) as (url, pid):
        async with aiohttp.ClientSession() as http:
            peers: list[Any] = []
            for _ in range(calls):
                if kind == "send-only":
                    peer: Any = HttpPeer(http, url)
                else:
                    speaking = kind.startswith("mic speaking")
                    mic = ClipTrack(speech if speaking else np.zeros(16000, np.float32), True)
                    peer = MicPeer(http, url, mic)
                await peer.connect()
                peers.append(peer)
            await asyncio.sleep(2.0)  # settle: DTLS, first frames, model warm-up
            cpu0, t0 = process_cpu_s(pid), time.monotonic()
            await asyncio.sleep(seconds)
            cpu1, t1 = process_cpu_s(pid), time.monotonic()
            for peer in peers:
                await peer.close()
    return 100.0 * (cpu1 - cpu0) / (t1 - t0) / calls


async def main_async(args: argparse.Namespace) -> None:
    restore = patch_aioice_loopback()
    pcm, spoken = caller_clip([2.5, QUESTION, 1.5])
    onset_s = spoken[0].start_s
    rows: list[dict] = []
    for mode in ("speech", "words"):
        rows += await latency(mode, args.trials, pcm, onset_s)
    speech, _ = caller_clip([QUESTION, 0.6])
    cpu: dict[str, list[float]] = {}
    for _ in range(args.cpu_runs):
        for kind in ("send-only", "mic silent", "mic speaking, no transcripts", "mic speaking"):
            value = await cpu_window(kind, args.calls, args.cpu_seconds, speech)
            cpu.setdefault(kind, []).append(value)
            print(f"  cpu {kind}: {value:.1f} % of a core per call", flush=True)
    restore()

    result_rows = []
    for mode in ("speech", "words"):
        ok = [r for r in rows if r["mode"] == mode and r.get("agent_playing_at_onset")]
        for metric in ("vad_onset_ms", "at_ms_error", "barge_in_ms"):
            values = [r[metric] for r in ok if metric in r]
            if values:
                result_rows.append({"mode": mode, "metric": metric, **summary(values)})
    for kind, values in cpu.items():
        result_rows.append({"mode": kind, "metric": "cpu_%_per_call", **summary(values)})
    load = os.getloadavg()
    print(f"\nload average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} ({os.cpu_count()} CPUs, shared)")
    print(table(result_rows, ["mode", "metric", "n", "p50", "p95", "min", "max"]))
    path = write_json(
        "listen_latency",
        {"args": vars(args), "trials": rows, "cpu": cpu, "summary": result_rows, "onset_s": onset_s},
    )
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--cpu-seconds", type=float, default=10.0)
    parser.add_argument("--cpu-runs", type=int, default=2)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
