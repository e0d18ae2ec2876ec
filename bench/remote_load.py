"""In-process vs remote (Ray Serve) engine: what the network seam costs a front-end.

    .venv/bin/python -m bench.remote_load [--levels 1 8 32] [--runs 2] [--models fake cv2]

Starts a one-machine Ray cluster on 127.0.0.1 in this process (one replica per model, `engine-serve`'s
deployment), and the same engines in-process. Per model, mode and level, N utterances start at once,
each into its own `RingSink`/`PcmRing`, read 20 ms at a time on an absolute schedule by one playout
thread, as calls play them. Reports, pooled over the runs:

- TTFA: `say()` -> the first PCM in the ring (front-end clock), p50/p95;
- added latency per chunk (remote only): the replica's write into its stream -> the front-end has the
  piece (both clocks are this machine's monotonic clock; the piece crosses Ray to the front-end's
  driver process, then the socketpair to the front-end), p50/p95;
- underrun frames: a 20 ms read, between an utterance's first sample and its end mark, that found less;
- front-end CPU per stream: this process's CPU time / wall time / N, in % of one core (in-process, this
  includes the synthesis itself; remote, only the front-end's part: client loop, resampling, ring,
  and its Ray driver process).

Models: `fake` (the fake engine, 50 ms TTFA, RTF 0.1) and `cv2` (the tiny random CosyVoice2 directory,
built into .models/cv2_tiny_speaking when missing). Prints a table; writes bench/results/remote_load.json.
On a shared 2-core box every number includes the other processes' load (see `loadavg` in the JSON).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import machine, summary, table, write_json
from voicertc.assemble import create_engine
from voicertc.audio import PcmRing, RingSink
from voicertc.config import Config, config_from_dict
from voicertc.engine.protocol import Done, EngineEvent, Failed

FAKE_TEXT = "The quick brown fox jumps over the lazy dog, while the band plays on."
CV2_TEXT = "Hello there, how are you today?"
FRAME_SAMPLES = 960  # 20 ms at 48 kHz
CV2_DIR = Path(".models/cv2_tiny_speaking")


class TimedSink(RingSink):
    """A call's sink that notes when its first PCM arrived (front-end clock)."""

    first_write_s: float | None = None

    def write(self, pcm: np.ndarray, sample_rate_hz: int, utterance_id: str, generation: int) -> bool:
        if self.first_write_s is None:
            self.first_write_s = time.monotonic()
        return super().write(pcm, sample_rate_hz, utterance_id, generation)


@dataclass
class Stream:
    ring: PcmRing
    sink: TimedSink
    said_s: float = 0.0
    started: bool = False
    ended: bool = False
    underrun_frames: int = 0
    events: list[EngineEvent] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def on_event(self, event: EngineEvent) -> None:
        self.events.append(event)
        if isinstance(event, Done | Failed):
            self.done.set()

    def play_frame(self) -> None:
        read = self.ring.read(FRAME_SAMPLES)
        if self.ended:
            return
        self.started = self.started or len(read.pcm) > 0
        self.ended = any(span.ended for span in read.spans)
        if self.started and not self.ended and len(read.pcm) < FRAME_SAMPLES:
            self.underrun_frames += 1


def play(streams: list[Stream], stop: threading.Event) -> None:
    next_s = time.monotonic()
    while not stop.is_set():
        for stream in streams:
            stream.play_frame()
        next_s += FRAME_SAMPLES / 48000
        stop.wait(max(0.0, next_s - time.monotonic()))


def front_end_cpu_s(engine: Any) -> float:
    """This process's CPU time, plus the remote engine's Ray driver process (the front-end's too)."""
    cpu_s = time.process_time()
    driver = getattr(engine, "driver_pid", None)
    if driver is not None:
        import psutil

        times = psutil.Process(driver).cpu_times()
        cpu_s += times.user + times.system
    return cpu_s


def run_level(engine: Any, text: str, n: int, timeout_s: float) -> dict[str, Any]:
    streams = []
    for _ in range(n):
        ring = PcmRing(high_water_ms=4000.0, margin_ms=500.0)
        streams.append(Stream(ring, TimedSink(ring)))
    delays = getattr(engine, "chunk_delays_ms", None)
    if delays is not None:
        delays.clear()
    stop = threading.Event()
    player = threading.Thread(target=play, args=(streams, stop), daemon=True)
    player.start()
    cpu0, wall0 = front_end_cpu_s(engine), time.monotonic()
    for stream in streams:
        stream.said_s = time.monotonic()
        engine.say(None, stream.sink, stream.on_event, text)
    finished = all(s.done.wait(max(0.0, wall0 + timeout_s - time.monotonic())) for s in streams)
    while not all(s.ended or not s.started for s in streams) and time.monotonic() < wall0 + timeout_s:
        time.sleep(0.02)  # playback reaches every end mark
    cpu_s, wall_s = front_end_cpu_s(engine) - cpu0, time.monotonic() - wall0
    stop.set()
    player.join()
    return {
        "n": n,
        "finished": finished,
        "failed": [e.message for s in streams for e in s.events if isinstance(e, Failed)],
        "ttfa_ms": [1000.0 * (s.sink.first_write_s - s.said_s) for s in streams if s.sink.first_write_s],
        "chunk_ms": list(delays) if delays is not None else [],
        "underrun_frames": sum(s.underrun_frames for s in streams),
        "cpu_pct_per_stream": 100.0 * cpu_s / wall_s / n,
    }


def configs(model: str) -> tuple[Config, str]:
    if model == "fake":
        return config_from_dict(
            {"engine": {"backend": "fake"}, "fake": {"ttfa_ms": 50, "rtf": 0.1}}
        ), FAKE_TEXT
    if not (CV2_DIR / "llm.pt").is_file():
        from bench.make_tiny_model_dir import make_tiny_model_dir

        make_tiny_model_dir(CV2_DIR)
    data = {"engine": {"backend": "cosyvoice2", "model_dir": str(CV2_DIR), "voices_dir": ""}}
    return config_from_dict(data), CV2_TEXT


def remote_config(app: str, max_n: int) -> Config:
    return config_from_dict(
        {
            "engine": {"backend": "ray", "max_ahead_ms": 2000},
            "limits": {"max_utterances": max_n + 8},
            "ray": {
                "app_name": app,
                "auth_mode": "disabled",  # as the bench's cluster (its driver process sets it)
                "open_timeout_s": 60.0,
                "stall_timeout_s": 60.0,
            },
        }
    )


def start_cluster(models: list[str], max_n: int) -> None:
    import ray
    from ray import serve

    from voicertc.assemble import create_local_engine
    from voicertc.remote.connect import apply_auth
    from voicertc.remote.deployment import build_app
    from voicertc.remote.loopback import loopback_init_options, not_a_cluster

    apply_auth(config_from_dict({"ray": {"auth_mode": "disabled"}}).ray)
    not_a_cluster()
    ray.init(num_cpus=4, namespace="voicertc", log_to_driver=False, **loopback_init_options())
    serve.start(proxy_location="Disabled")
    for model in models:
        local, _ = configs(model)
        local = local.replace("limits", max_utterances=max_n + 8)
        local = local.replace("ray", num_replicas=1, num_cpus=1.0, max_ongoing_requests=4 * max_n + 16)
        serve.run(build_app(local, create_local_engine), name=f"bench-{model}", route_prefix=None)


def measure(engine: Any, text: str, levels: list[int], runs: int, timeout_s: float) -> list[dict[str, Any]]:
    engine.start()
    try:
        run_level(engine, text, 1, timeout_s)  # warm-up
        pooled = []
        for n in levels:
            results = [run_level(engine, text, n, timeout_s) for _ in range(runs)]
            pooled.append(
                {
                    "n": n,
                    "runs": results,
                    "ttfa_ms": summary([v for r in results for v in r["ttfa_ms"]]),
                    "chunk_ms": summary([v for r in results for v in r["chunk_ms"]])
                    if results[0]["chunk_ms"]
                    else None,
                    "underrun_frames": [r["underrun_frames"] for r in results],
                    "cpu_pct_per_stream": summary([r["cpu_pct_per_stream"] for r in results]),
                    "failed": sum(len(r["failed"]) for r in results),
                }
            )
        return pooled
    finally:
        engine.stop()


def row(model: str, mode: str, level: dict[str, Any]) -> dict[str, object]:
    chunk = level["chunk_ms"] or {}
    return {
        "model": model,
        "engine": mode,
        "utterances": level["n"],
        "ttfa p50 ms": level["ttfa_ms"]["p50"],
        "ttfa p95 ms": level["ttfa_ms"]["p95"],
        "chunk +ms p50": chunk.get("p50", "-"),
        "chunk +ms p95": chunk.get("p95", "-"),
        "underruns": "/".join(str(u) for u in level["underrun_frames"]),
        "cpu %/stream": level["cpu_pct_per_stream"]["p50"],
        "failed": level["failed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["fake", "cv2"], choices=["fake", "cv2"])
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    max_n = max(args.levels)
    rows, record = [], {"args": vars(args), "machine_before": machine(), "results": {}}
    for model in args.models:
        local, text = configs(model)
        local = local.replace("limits", max_utterances=max_n + 8)
        record["results"][f"{model}/in-process"] = levels = measure(
            create_engine(local), text, args.levels, args.runs, args.timeout_s
        )
        rows += [row(model, "in-process", level) for level in levels]
    start_cluster(args.models, max_n)
    from voicertc.remote.client import RemoteEngine

    for model in args.models:
        remote = RemoteEngine(remote_config(f"bench-{model}", max_n))
        record["results"][f"{model}/remote"] = levels = measure(
            remote, configs(model)[1], args.levels, args.runs, args.timeout_s
        )
        rows += [row(model, "remote", level) for level in levels]
    record["machine_after"] = machine()
    print(table(rows, list(rows[0])))  # noqa: T201 - benchmark output
    print("wrote", write_json("remote_load", record))  # noqa: T201
    import ray

    ray.shutdown()


if __name__ == "__main__":
    main()
