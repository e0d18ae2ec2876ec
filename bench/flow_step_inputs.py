"""What a flow step's cached keys and values cost to bring into the static step, before and after
`PackedKV` (every Euler step of every chunk reads its own K/V of every frame so far).

Before: each utterance's context made whole (its shared prompt prefix and its own frames concatenated),
the utterances concatenated, then copied into the bucket's static buffer. After: each utterance's frames
written straight into the static buffer (`PackedKV.fill`). Full-size CosyVoice2 layout by default (56
attentions, 8 heads of 64), a 3 s prompt shared by every utterance; bf16 as served on a GPU.

    .venv/bin/python -m bench.flow_step_inputs [--device cpu] [--utterances 1 4 8] [--own 100 350] [--runs 7]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.report import summary, table, write_json
from voicertc.backends.cosyvoice.flow.graph import PackedKV
from voicertc.backends.cosyvoice.flow.unet import PackedCache

ROWS = 2  # CFG rows per utterance


def _contexts(n: int, prompt: int, own: int, shape: tuple[int, int, int], dtype, device) -> list[PackedCache]:
    slots, heads, dh = shape
    kv = torch.randn(slots, 2, ROWS, heads, prompt, dh, dtype=dtype, device=device)
    voice = PackedCache(torch.zeros(ROWS, 8, 2, dtype=dtype, device=device), kv, prompt, ((0, 8),))
    contexts = []
    for _ in range(n):
        ctx = voice.share()
        ctx.store(ctx.conv, torch.randn(slots, 2, ROWS, heads, own, dh, dtype=dtype, device=device))
        contexts.append(ctx)
    return contexts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, runs: int, device: torch.device) -> list[float]:
    out = []
    for _ in range(runs + 1):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        out.append(1000 * (time.perf_counter() - started))
    return out[1:]  # the first run warms the allocator


def measure(n: int, own: int, args: argparse.Namespace) -> dict[str, object]:
    """Before / after times of one Euler step's K/V input for `n` utterances of `own` frames each."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    contexts = _contexts(n, args.prompt, own, tuple(args.layout), dtype, device)
    keys = args.key_quantum
    while keys < args.prompt + own:
        keys *= 2
    kv = PackedKV(tuple(contexts), ROWS, keys, dtype)
    static = torch.zeros(kv.shape, dtype=dtype, device=device)

    def before() -> None:
        for c in contexts:
            c.reserve(keys)
        static.copy_(torch.cat([c.context(keys) for c in contexts], dim=2))

    b, a = (
        summary(_time(before, args.runs, device)),
        summary(_time(lambda: kv.fill(static), args.runs, device)),
    )
    return {
        "utterances": n, "own_frames": own, "keys": keys,
        "step_kv_mb": static.numel() * static.element_size() / 2**20,
        "before_ms_p50": b["p50"], "before_ms_p95": b["p95"],
        "after_ms_p50": a["p50"], "after_ms_p95": a["p95"],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--utterances", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--own", type=int, nargs="+", default=[100, 350], help="own frames (50 a second)")
    parser.add_argument("--prompt", type=int, default=150, help="shared prompt frames")
    parser.add_argument("--layout", type=int, nargs=3, default=[56, 8, 64], metavar=("SLOTS", "HEADS", "DH"))
    parser.add_argument("--key-quantum", type=int, default=64)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    rows = [measure(n, own, args) for n in args.utterances for own in args.own]
    columns = ["utterances", "own_frames", "keys", "step_kv_mb", "before_ms_p50", "before_ms_p95",
               "after_ms_p50", "after_ms_p95"]  # fmt: skip
    print(table(rows, columns))  # noqa: T201 - a benchmark's report
    record = {"device": args.device, "dtype": args.dtype, "layout": args.layout, "prompt": args.prompt}
    print("wrote", write_json("flow_step_inputs", {**record, "rows": rows}))  # noqa: T201


if __name__ == "__main__":
    main()
