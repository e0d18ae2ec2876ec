"""How long one CosyVoice2 engine unit holds the engine thread, with and without `[engine] max_step_ms`.

    .venv/bin/python -m bench.cv2_step_bounds [--max-step-ms 0 200] [--runs 2] [--max-tokens 100]
    .venv/bin/python -m bench.cv2_step_bounds --version 3   # CosyVoice3 (.models/cv3_full)

The real engine (`EngineWorker` + `CosyVoice2Backend`) on the full-size random-weight directory (CPU by
default: where a flow chunk's ten Euler steps take seconds). One utterance speaks `--max-tokens` tokens;
per budget it reports its units' wall and engine-thread CPU time by stage (p50 / p95 / max, and how many
passed the budget), its TTFA and engine time (splitting costs nothing when the steps are the same).
Then a second utterance is cancelled `--cancel-after-s` into its first flow unit: the time from `cancel`
to its `Cancelled` event is how long one unit holds a cancel (or another call's urgent unit) back.
Prints tables; writes bench/results/cv2_step_bounds_cpu.json (cv3_step_bounds_cpu.json for `--version 3`).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import defaultdict

import torch

from bench.cv2_load import TEXT, Playout, pick_voice, play
from bench.make_full_model_dir import DEFAULT_OUT, DEFAULT_OUT_V3, make_full_model_dir
from bench.report import summary, table, write_json
from voicertc.audio import PcmRing, RingSink
from voicertc.backends.cosyvoice.load import load_v2 as load
from voicertc.backends.cosyvoice.load import load_v3
from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
from voicertc.backends.cosyvoice.load.v3 import CosyVoice3Model
from voicertc.backends.cosyvoice.serve.backend import BackendOptions, CosyVoice2Backend
from voicertc.backends.cosyvoice.serve.backend_v3 import CosyVoice3Backend
from voicertc.engine import Cancelled, Done, EngineEvent, Failed, FirstAudio
from voicertc.engine.work import FlowChunk, stage_name
from voicertc.engine.worker import EngineWorker


class UnitTimes:
    """Wraps `backend.run` (engine thread): each unit's stage, wall and thread CPU seconds."""

    def __init__(self, backend: CosyVoice2Backend) -> None:
        self.units: list[tuple[str, float, float]] = []
        self.on_flow: threading.Event | None = None  # set at the first flow unit
        run = backend.run

        def timed(batch, now_s):  # type: ignore[no-untyped-def]
            if self.on_flow is not None and isinstance(batch[0].work, FlowChunk):
                self.on_flow.set()
            wall, cpu = time.perf_counter(), time.thread_time()
            results = run(batch, now_s)
            self.units.append(
                (stage_name(batch[0].work), time.perf_counter() - wall, time.thread_time() - cpu)
            )
            return results

        backend.run = timed  # type: ignore[method-assign]


def one_run(
    model: CosyVoice2Model, max_step_ms: float, max_tokens: int, cancel_after_s: float, timeout_s: float
) -> dict[str, object]:
    options = BackendOptions(seed=5, max_segment_tokens=max_tokens, max_step_ms=max_step_ms)
    backend_class = CosyVoice3Backend if isinstance(model, CosyVoice3Model) else CosyVoice2Backend
    backend = backend_class(model, options=options)
    voice = pick_voice(backend, model)
    backend.warm_up()
    times = UnitTimes(backend)
    engine = EngineWorker(backend, default_voice=voice, max_utterances=4)
    streams = [Playout(PcmRing(high_water_ms=4000.0, margin_ms=500.0)) for _ in range(2)]
    stop, flow_started, cancelled = threading.Event(), threading.Event(), threading.Event()
    player = threading.Thread(target=play, args=(streams, stop), daemon=True)
    engine.start()
    player.start()
    try:
        times.units.clear()
        engine.say(voice, RingSink(streams[0].ring), streams[0].on_event, TEXT)
        finished = streams[0].done.wait(timeout_s)
        units = list(times.units)
        times.on_flow = flow_started  # the second utterance is cancelled inside its first flow unit

        def on_event(event: EngineEvent) -> None:
            streams[1].on_event(event)
            if isinstance(event, Cancelled | Done | Failed):
                cancelled.set()

        uid = engine.say(voice, RingSink(streams[1].ring), on_event, TEXT)
        flow_started.wait(timeout_s)
        time.sleep(cancel_after_s)
        cancel_s = time.monotonic()
        engine.cancel(uid)
        cancelled.wait(timeout_s)
        was_cancelled = any(isinstance(e, Cancelled) for e in streams[1].events)
        cancel_ms = 1000.0 * (time.monotonic() - cancel_s) if was_cancelled else None  # None: it had ended
    finally:
        stop.set()
        stop_s = time.monotonic()
        engine.stop()
        player.join()
    done = [e for e in streams[0].events if isinstance(e, Done)]
    by_stage: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for stage, wall_s, cpu_s in units:
        by_stage[stage].append((wall_s * 1000.0, cpu_s * 1000.0))
    return {
        "max_step_ms": max_step_ms,
        "finished": finished,
        "ttfa_ms": next((e.ttfa_ms for e in streams[0].events if isinstance(e, FirstAudio)), None),
        "synth_s": done[0].metrics.get("synth_s") if done else None,
        "audio_ms": done[0].audio_ms if done else None,
        "cancel_to_cancelled_ms": cancel_ms,
        "stop_s": time.monotonic() - stop_s,
        "stages": {
            stage: {
                "units": len(rows),
                "wall_ms": summary([w for w, _ in rows]),
                "cpu_ms": summary([c for _, c in rows]),
                "over_budget": sum(1 for _, c in rows if max_step_ms and c > max_step_ms),
            }
            for stage, rows in by_stage.items()
        },
    }


def _rows(results: list[dict]) -> list[dict[str, object]]:
    rows = []
    for r in results:
        for stage, s in sorted(r["stages"].items()):
            rows.append({
                "max_step_ms": r["max_step_ms"] or "off",
                "stage": stage,
                "units": s["units"],
                "cpu p50 ms": s["cpu_ms"]["p50"],
                "cpu p95 ms": s["cpu_ms"]["p95"],
                "cpu max ms": s["cpu_ms"]["max"],
                "wall max ms": s["wall_ms"]["max"],
                "over budget": s["over_budget"],
            })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", type=int, choices=[2, 3], default=2, help="CosyVoice2 or 3")
    parser.add_argument("--model-dir", help=f"default {DEFAULT_OUT} ({DEFAULT_OUT_V3} for --version 3)")
    parser.add_argument("--max-step-ms", type=float, nargs="+", default=[0.0, 200.0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cancel-after-s", type=float, default=1.0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model_dir is None:
        default = DEFAULT_OUT_V3 if args.version == 3 else DEFAULT_OUT
        args.model_dir = str(make_full_model_dir(default, version=args.version))
    loader = load_v3 if args.version == 3 else load
    model = loader(args.model_dir, "cpu", torch.float32)
    results = [
        one_run(model, ms, args.max_tokens, args.cancel_after_s, args.timeout_s)
        for _ in range(args.runs)
        for ms in args.max_step_ms
    ]
    print(table(_rows(results), list(_rows(results)[0])))  # noqa: T201 - benchmark output
    others = [
        {
            "max_step_ms": r["max_step_ms"] or "off",
            "ttfa ms": r["ttfa_ms"],
            "engine s": r["synth_s"],
            "audio ms": r["audio_ms"],
            "cancel -> Cancelled ms": r["cancel_to_cancelled_ms"],
        }
        for r in results
    ]
    print(table(others, list(others[0])))  # noqa: T201
    name = f"cv{args.version}_step_bounds_cpu"
    print("wrote", write_json(name, {"args": vars(args), "results": results}))  # noqa: T201


if __name__ == "__main__":
    main()
