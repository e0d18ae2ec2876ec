"""How many kernels a captured step launches, eager vs compiled (`[engine] compile` with `cuda_graphs`).

On a GPU a replayed static step is bound by its count of small kernels (the H100 runs of 2026-11-26/27:
a decode step ~500 kernels, 4.3 ms for ~0.35 ms of weight reads; an Euler step of the flow ~2,000).
This counts, on any device, what each static step would launch:
- eager: the ATen operators the step dispatches that are not views (each one kernel or more);
- compiled: the calls in inductor's generated program for the same step (fused kernels, plus the
  extern matmuls / convolutions / attention and any ATen fallbacks), and how long the compile took.
On a CPU inductor writes C++ loops instead of Triton kernels, but it groups the operators the same way
(the same scheduler), so the ratio is the GPU's to expect, not its milliseconds.

    .venv/bin/python -m bench.step_kernels [--model-dir D] [--rows 1 16] [--part decode flow]
"""

from __future__ import annotations

import argparse
import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.make_full_model_dir import DEFAULT_OUT
from bench.report import table, write_json
from voicertc.backends.cosyvoice.accel.compiled import compiled_step
from voicertc.backends.cosyvoice.accel.flow_onnx_export import example_inputs
from voicertc.backends.cosyvoice.flow.flow import CausalFlow
from voicertc.backends.cosyvoice.flow.graph import StreamingEstimator
from voicertc.backends.cosyvoice.flow.qkv import fuse_qkv
from voicertc.backends.cosyvoice.llm.graphs import DecodeGraphs
from voicertc.backends.cosyvoice.llm.kv import SlotKV
from voicertc.backends.cosyvoice.load.v2 import load_llm


class _OpCount(TorchDispatchMode):
    """ATen operators dispatched, views left out (they launch nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def eager_ops(fn: Callable[..., Any], *args: Any) -> Counter[str]:
    with torch.inference_mode(), _OpCount() as counting:
        fn(*args)
    return counting.ops


# a launch in the generated `call`: `buf3 = extern_kernels.mm(...)`, `torch.ops.aten.x.default(...)`,
# `cpp_fused_add_0(...)` (CPU) / `triton_poi_fused_add_0.run(...)` (CUDA)
_CALL = re.compile(
    r"^\s+(?:\w+(?:, \w+)* = )?(?P<what>(?:extern_kernels|torch\.ops)\.[\w.]+|\w*fused\w*)(?:\.run)?\("
)


def _kind(what: str) -> str:
    if "fused" in what:
        return "fused"
    parts = what.split(".")
    return parts[-2] if parts[-1] == "default" else parts[-1]


def compiled_calls(fn: Callable[..., Any], *args: Any) -> tuple[Counter[str], float]:
    """The launches in inductor's generated program for `fn(*args)` (by kind) and the compile seconds."""
    from torch._inductor.utils import run_and_get_code

    started = time.perf_counter()
    with torch.inference_mode():
        _, sources = run_and_get_code(fn, *args)
    seconds = time.perf_counter() - started
    calls: Counter[str] = Counter()
    for source in sources:
        body = source.split("def call(", 1)[1] if "def call(" in source else source
        for line in body.splitlines():
            match = _CALL.match(line)
            if match:
                calls[_kind(match["what"])] += 1
    return calls, seconds


def decode_rows(model_dir: str, rows: list[int], device: str) -> list[dict[str, object]]:
    llm = load_llm(model_dir, device)
    backbone, head = llm.llm.model.model, llm.llm_decoder
    out = []
    for n in rows:
        pool = SlotKV(backbone, slots=n + 1, capacity=2048, fused=True)  # the CUDA path's layer, capacity
        graphs = DecodeGraphs(pool, head, max_rows=n)
        index = torch.arange(n, device=device)
        positions = torch.full((n, 1), 100, device=device)
        embeds = torch.randn(n, 1, backbone.config.hidden_size, device=device)
        ops = eager_ops(graphs._static_logits, index, positions, embeds)
        torch._dynamo.reset()
        step = compiled_step(graphs._static_logits, dynamic=None)
        calls, seconds = compiled_calls(step, index, positions, embeds)
        out.append(_row(f"decode step, {n} rows", ops, calls, seconds))
    return out


def flow_rows(
    model_dir: str, rows: list[int], device: str, join: bool, compile: bool
) -> list[dict[str, object]]:
    """The flow's Euler step as the captured path runs it (q/k/v stacked, the new keys written into the
    room the static input keeps for them), or with `join` as before (the cached keys joined to the new)."""
    flow = CausalFlow.from_model_dir(model_dir, device)
    fuse_qkv(flow.decoder.estimator)  # as the captured path installs it
    module = StreamingEstimator(flow.decoder.estimator).to(device)
    module = module if join else module.with_kv_room()
    form = "joined keys" if join else "keys in room"
    out = []
    for n in rows:  # n utterances: 2n CFG rows; a first chunk's shapes (64 new frames, 256 cached keys)
        inputs = [t.to(device) for t in example_inputs(module.layout, rows=2 * n, frames=64, cached=256)]
        if not join:
            inputs[6] = torch.nn.functional.pad(inputs[6], (0, 0, 0, 64))
        ops = eager_ops(module, *inputs)
        calls, seconds = Counter[str](), float("nan")
        if compile:
            torch._dynamo.reset()
            calls, seconds = compiled_calls(compiled_step(module), *inputs)
        out.append(_row(f"flow Euler step, {n} utterances, {form}", ops, calls, seconds))
    return out


def _row(step: str, ops: Counter[str], calls: Counter[str], seconds: float) -> dict[str, object]:
    eager, compiled = sum(ops.values()), sum(calls.values())
    return {
        "step": step,
        "eager ops": eager,
        "compiled calls": compiled,
        "fused kernels": calls["fused"],
        "x fewer": eager / max(compiled, 1),
        "compile s": seconds,
        "top eager ops": ", ".join(f"{k} {v}" for k, v in ops.most_common(6)),
        "compiled by kind": dict(calls),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default=str(DEFAULT_OUT))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--part", nargs="+", choices=["decode", "flow"], default=["decode", "flow"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flow-join", action="store_true", help="the flow step joining cached and new keys")
    parser.add_argument("--eager-only", action="store_true", help="count eager operators only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[dict[str, object]] = []
    if "decode" in args.part:
        rows += decode_rows(args.model_dir, args.rows, args.device)
    if "flow" in args.part:
        rows += flow_rows(args.model_dir, args.rows, args.device, args.flow_join, not args.eager_only)
    columns = ["step", "eager ops", "compiled calls", "fused kernels", "x fewer", "compile s"]
    print(table(rows, columns))  # noqa: T201 - benchmark output
    for r in rows:
        print(f"{r['step']}: eager {r['top eager ops']}; compiled {r['compiled by kind']}")  # noqa: T201
    path = write_json(f"step_kernels_{args.device.split(':')[0]}", {"args": vars(args), "rows": rows})
    print("wrote", path)  # noqa: T201


if __name__ == "__main__":
    main()
