"""The `voicertc export vllm|onnx` and `voicertc doctor` subcommands (torch imported only when run)."""

from __future__ import annotations

import argparse
import logging
import sys

from voicertc.errors import VoiceRTCError


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    export = commands.add_parser("export", help="export a CosyVoice2 model directory for vLLM / ONNX")
    kinds = export.add_subparsers(dest="export_kind", required=True)
    vllm = kinds.add_parser("vllm", help="the speech LLM as a Hugging Face model for vLLM")
    vllm.add_argument("model_dir", help="CosyVoice2 model directory")
    vllm.add_argument("out", help="output directory (config.json, model.safetensors)")
    vllm.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    onnx = kinds.add_parser("onnx", help="the streaming flow estimator and HiFT as ONNX")
    onnx.add_argument("model_dir", help="CosyVoice2 model directory")
    onnx.add_argument("out", help="output directory (flow_estimator_stream.onnx, hift.onnx)")
    onnx.add_argument("--opset", type=int, default=18)
    doctor = commands.add_parser(
        "doctor", help="check every accelerated path against eager fp32; print a report"
    )
    doctor.add_argument(
        "--model-dir",
        required=True,
        help="CosyVoice2 model directory (a tiny random one: python -m bench.make_tiny_model_dir OUT)",
    )
    doctor.add_argument("--skip-tests", action="store_true", help="do not run the gpu-marked pytest suite")
    doctor.add_argument("--runs", type=int, default=3, help="timed runs per measurement")
    doctor.add_argument(
        "--quick", action="store_true", help="short workloads, no torch.compile (minutes less)"
    )


def run(args: argparse.Namespace) -> int:
    """Run an `export` or `doctor` command; returns the process exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "doctor":
            from voicertc.export.doctor import run_doctor

            return run_doctor(args.model_dir, run_tests=not args.skip_tests, runs=args.runs, quick=args.quick)
        if args.export_kind == "vllm":
            from voicertc.backends.cosyvoice.accel.vllm_export import export_vllm

            print(export_vllm(args.model_dir, args.out, dtype=args.dtype))
            return 0
        from voicertc.backends.cosyvoice.accel.onnx_export import export_onnx

        for path in export_onnx(args.model_dir, args.out, opset=args.opset):
            print(path)
        return 0
    except (OSError, ValueError, VoiceRTCError) as exc:
        print(f"voicertc {args.command}: {exc}", file=sys.stderr)
        return 1
