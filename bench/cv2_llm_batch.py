"""Batched LLM decode on the slot KV cache: ms per step and tokens/s at batch 1, 2, 4, 8 (full size).

    .venv/bin/python -m bench.make_full_model_dir             # random full-size weights (once)
    .venv/bin/python -m bench.cv2_llm_batch [--model-dir .models/cv2_full] [--batch 1 2 4 8]
    python -m bench.cv2_llm_batch --device cuda --dtype bfloat16 --graphs --batch 1 8 16 32   # GPU

B sessions (30 text tokens, a 75-token prompt, RAS sampling with their own generators) are prefilled
on their own slots of one `SlotKV`, then `decode_batch` runs all B rows per step. Reports wall ms per
step (p50 over the runs), the engine thread's CPU ms per step, and total tokens/s (B / step time), with
the speed-up over batch 1. `--graphs` runs the batched rows as CUDA graph replays (`DecodeGraphs`, one
per (batch, key span) bucket; CUDA only); `--ahead` with it launches each step before reading the
one before (`llm.ahead`, what the engine runs): ms per step is then the time between two reads. Writes
bench/results/cv2_llm_batch_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench.make_full_model_dir import DEFAULT_OUT
from bench.report import summary, table, write_json
from voicertc.backends.cosyvoice.llm.ahead import launch, read
from voicertc.backends.cosyvoice.llm.batch import decode_batch
from voicertc.backends.cosyvoice.llm.graphs import DecodeGraphs
from voicertc.backends.cosyvoice.llm.kv import SlotKV
from voicertc.backends.cosyvoice.load.v2 import load_llm


def run_batch(
    llm,
    batch: int,
    steps: int,
    warmup: int,
    device: str,
    graphs: bool,
    compile: bool = False,
    capacity: int = 512,
    ahead: bool = False,
) -> dict[str, object]:
    pool = SlotKV(llm.llm.model.model, slots=max(batch, 1) + 1, capacity=capacity)
    static = DecodeGraphs(pool, llm.llm_decoder, max_rows=batch, compile=compile) if graphs else None
    gen = torch.Generator().manual_seed(1)
    sessions = []
    for row in range(batch):
        text = torch.randint(0, 1000, (30,), generator=gen).tolist()
        speech = torch.randint(0, 6561, (75,), generator=gen).tolist()
        session = llm.prefill(
            text, text[:10], speech, generator=torch.Generator(device).manual_seed(row), kv=pool.acquire()
        )
        session.min_len, session.max_len = 10_000, 10_000  # never stops during the timing
        sessions.append(session)
    first = decode_batch(llm, sessions, static)  # the prompts (fed row by row)
    assert all(isinstance(t, int) for t in first), first
    for _ in range(warmup):
        decode_batch(llm, sessions, static)
    if ahead:
        assert static is not None
        wall, cpu = _ahead_steps(llm, static, sessions, steps)
    else:
        wall, cpu = _read_steps(llm, static, sessions, steps, device)
    step = summary(wall)
    return {
        "batch": batch,
        "ms_per_step": step,
        "cpu_ms_per_step": summary(cpu),
        "tokens_per_s": 1000.0 * batch / step["p50"],
    }


def _read_steps(llm, static, sessions, steps: int, device: str) -> tuple[list[float], list[float]]:
    """Each step launched and read (`decode_batch`): wall and CPU ms a step."""
    wall, cpu = [], []
    for _ in range(steps):
        started, cpu_started = time.perf_counter(), time.thread_time()
        out = decode_batch(llm, sessions, static)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall.append(1000 * (time.perf_counter() - started))
        cpu.append(1000 * (time.thread_time() - cpu_started))
        assert all(isinstance(t, int) for t in out), out
    return wall, cpu


def _ahead_steps(llm, static, sessions, steps: int) -> tuple[list[float], list[float]]:
    """Each step launched before the one before is read (`llm.ahead`): wall and CPU ms between reads."""
    wall, cpu = [], []
    before = None
    last, cpu_last = time.perf_counter(), time.thread_time()
    for _ in range(steps + 1):
        now = launch(llm, static, sessions, before)
        if before is not None:
            out = read(llm, before)
            assert all(isinstance(t, int) and t >= 0 for t in out), out
            at, cpu_at = time.perf_counter(), time.thread_time()
            wall.append(1000 * (at - last))
            cpu.append(1000 * (cpu_at - cpu_last))
            last, cpu_last = at, cpu_at
        before = now
    assert before is not None
    read(llm, before)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default=str(DEFAULT_OUT))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--graphs", action="store_true", help="CUDA graph per batch bucket (CUDA only)")
    parser.add_argument("--compile", action="store_true", help="with --graphs: the static step compiled")
    parser.add_argument(
        "--ahead", action="store_true", help="with --graphs: launch before reading (llm.ahead)"
    )
    parser.add_argument(
        "--capacity",
        type=int,
        default=512,
        help="K/V positions per slot (the engine's with cuda_graphs: 2048, `GRAPH_KV_CAPACITY`); a "
        "replayed step attends over its rows' span bucket (256, 512, ...), not all of them",
    )
    args = parser.parse_args()
    if args.compile and not args.graphs:
        parser.error("--compile compiles the static step of --graphs")
    if args.ahead and not args.graphs:
        parser.error("--ahead runs the static steps of --graphs")
    torch.set_num_threads(args.threads)
    llm = load_llm(args.model_dir, args.device, dtype=getattr(torch, args.dtype))
    llm.min_len_ban_ids = tuple(sorted(llm.stop_ids))  # random weights: no row ends during the timing
    results = [
        run_batch(
            llm, b, args.steps, args.warmup, args.device, args.graphs, args.compile, args.capacity, args.ahead
        )
        for b in args.batch
    ]
    base = results[0]["tokens_per_s"]
    rows = [
        {
            "batch": r["batch"],
            "ms/step p50": r["ms_per_step"]["p50"],
            "ms/step p95": r["ms_per_step"]["p95"],
            "cpu ms/step p50": r["cpu_ms_per_step"]["p50"],
            "tokens/s": r["tokens_per_s"],
            "x batch 1": r["tokens_per_s"] / base,
        }
        for r in results
    ]
    print(table(rows, list(rows[0])))
    load = os.getloadavg()[0]
    print(f"load average (1 min): {load:.1f}")
    path = write_json(
        f"cv2_llm_batch_{args.device.replace(':', '')}_{args.dtype}"
        + ("_graphs" if args.graphs else "")
        + ("_compiled" if args.compile else "")
        + ("_ahead" if args.ahead else ""),
        {"args": vars(args), "results": results, "load_avg_1m": load},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
