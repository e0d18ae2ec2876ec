"""CosyVoice2 acceleration paths on CPU, full-size random weights: eager fp32 vs bf16 vs torch.compile vs
onnxruntime. ms per LLM token and per flow chunk (p50/p95 over every step of every run) and deviations
from eager fp32 (greedy-token agreement over 200 LLM tokens, teacher-forced; max mel error over a
streamed utterance). See voicertc.export.measure for the method.

    .venv/bin/python -m bench.accel_cpu [--model-dir .models/cv2_full] [--runs 3] [--paths ...]
    python -m bench.accel_cpu --device cuda   # CUDA paths: fp32, bf16, fp16, cuda graphs (+bf16), compile

Prints a table; writes bench/results/accel_cpu.json. The LLM has no ONNX path: the onnx row's LLM
numbers are eager fp32 again (a same-run control for the machine's load).
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import asdict
from pathlib import Path

import torch

from bench.make_full_model_dir import DEFAULT_OUT, make_full_model_dir
from bench.report import table, write_json
from voicertc.export.measure import CUDA_PATHS, PATHS, Workload, measure_paths


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default=str(DEFAULT_OUT))
    parser.add_argument("--onnx-dir", default="", help="exported graphs (default: <model-dir>/accel)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--llm-tokens", type=int, default=200)
    parser.add_argument("--speech-tokens", type=int, default=250)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--paths", nargs="+", default=None, choices=sorted(set(PATHS + CUDA_PATHS)))
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    paths = tuple(args.paths or (CUDA_PATHS if cuda else PATHS))
    torch.set_num_threads(args.threads)
    if args.model_dir == str(DEFAULT_OUT):
        make_full_model_dir(DEFAULT_OUT)
    onnx_dir = Path(args.onnx_dir or Path(args.model_dir) / "accel")
    load_before = os.getloadavg()
    work = Workload(llm_tokens=args.llm_tokens, speech_tokens=args.speech_tokens, runs=args.runs)

    def partial(result: object) -> None:  # each path's row as soon as it is measured (slow machines)
        print(table([result.row()], list(result.row())), flush=True)  # type: ignore[attr-defined]  # noqa: T201

    results = measure_paths(args.model_dir, onnx_dir, paths, work, on_result=partial, device=args.device)
    rows = [r.row() for r in results]
    print(table(rows, list(rows[0])))  # noqa: T201 - benchmark output
    print(f"load average before {load_before}, after {os.getloadavg()}")  # noqa: T201
    record = {"args": vars(args), "load_before": load_before, "results": [asdict(r) for r in results]}
    print("wrote", write_json("accel_cpu" if not cuda else "accel_cuda", record))  # noqa: T201


if __name__ == "__main__":
    main()
