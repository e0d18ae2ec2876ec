"""`voicertc doctor [--model-dir D]`: one command that checks every accelerated path against eager fp32
and prints a report to paste into a bug report (versions, device, each check PASS/FAIL/SKIP with numbers).

CPU: the vLLM export against our LLM (transformers, logits), the ONNX estimator and HiFT against the
eager modules (ONNX Runtime, a streamed utterance), bf16 / torch.compile / ONNX speed and deviation.
CUDA (additionally): the `gpu`-marked pytest suite, and the engine under load (bench.cv2_load: TTFA
p50/p95 at 1/8/32 utterances, RTF, underrun frames; both need a source checkout's tests/ and bench/,
run as subprocesses). The model directory is required: a real one, or the tiny random one a source
checkout builds with `python -m bench.make_tiny_model_dir OUT` (the package never imports bench/).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
PARITY_TOL = 1e-4
BF16_MIN_AGREEMENT = 0.5  # bf16 flips near-ties of random weights; a broken path agrees ~1/vocab
BF16_MAX_MEL_ERROR = 1.0  # log-mel units; a broken path is off by the whole dynamic range
RUN_TO_RUN_MAX = 1e-2  # eager fp32 streamed twice on one device; more means nondeterminism worth a report


@dataclass
class Check:
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str

    def line(self) -> str:
        return f"[{self.status}] {self.name}: {self.detail}"


def versions() -> list[str]:
    lines = [f"python {platform.python_version()} on {platform.platform()}"]
    for name in ("torch", "transformers", "onnx", "onnxruntime", "vllm", "tensorrt"):
        try:
            module = importlib.import_module(name)
            lines.append(f"{name} {getattr(module, '__version__', '?')}")
        except Exception:  # not installed (vllm / tensorrt on CPU machines), or broken
            lines.append(f"{name} not installed")
    return lines


def device_lines() -> list[str]:
    import torch

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [f"cpu {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {load}"]
    lines.append(f"torch threads {torch.get_num_threads()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            memory = f"{props.total_memory / 2**30:.0f} GiB"
            lines.append(f"cuda:{i} {props.name}, {memory}, cc {props.major}.{props.minor}")
    else:
        lines.append("cuda: not available")
    return lines


def _guard(name: str, fn: Callable[[], Check]) -> Check:
    try:
        return fn()
    except Exception as exc:
        logger.exception("doctor check %s", name)
        return Check(name, "FAIL", f"{type(exc).__name__}: {exc}"[:300])


def check_vllm_export(model_dir: Path, work: Path) -> Check:
    import torch

    from voicertc.backends.cosyvoice.accel.vllm_export import export_vllm, load_exported
    from voicertc.backends.cosyvoice.load.v2 import load_llm

    out = export_vllm(model_dir, work / "vllm")
    llm = load_llm(model_dir)
    text, speech = [5, 9, 17, 3, 40, 41], [1, 2, 3, 100, 200]
    expected = llm.logits(text, (), speech)[0]
    with torch.inference_mode():
        got = load_exported(out)(inputs_embeds=llm.lm_input(text, (), speech)).logits[0]
    err = float((got - expected).abs().max())
    status = "PASS" if err <= PARITY_TOL else "FAIL"
    return Check("vllm export (transformers logits)", status, f"max |logit err| {err:.2e} (<= {PARITY_TOL})")


def check_onnx_estimator(model_dir: Path, onnx_dir: Path) -> Check:
    from voicertc.backends.cosyvoice.accel.onnx_export import ESTIMATOR_FILE, export_onnx
    from voicertc.backends.cosyvoice.flow.flow import CausalFlow
    from voicertc.backends.cosyvoice.flow.graph import GraphLayout, OnnxRuntimeEstimator
    from voicertc.export.measure import flow_inputs, flow_stream

    export_onnx(model_dir, onnx_dir)
    flow = CausalFlow.from_model_dir(model_dir).eval()
    inputs = flow_inputs(flow, speech_tokens=150)
    eager, _ = flow_stream(flow, inputs)
    layout = GraphLayout.of(flow.decoder.estimator)
    flow.decoder.estimator_runner = OnnxRuntimeEstimator(onnx_dir / ESTIMATOR_FILE, layout)
    got, _ = flow_stream(flow, inputs)
    err = float((got - eager).abs().max())
    status = "PASS" if err <= PARITY_TOL else "FAIL"
    detail = f"max |mel err| {err:.2e} over {eager.shape[2]} frames (<= {PARITY_TOL})"
    return Check("onnx flow estimator (onnxruntime, streamed)", status, detail)


def check_onnx_hift(model_dir: Path, onnx_dir: Path) -> Check:
    import torch

    from voicertc.backends.cosyvoice.accel.hift_ort import OnnxHift
    from voicertc.backends.cosyvoice.accel.onnx_export import load_hift
    from voicertc.backends.cosyvoice.hift.stream import hift_stream_step, init_hift_stream_state

    hift = load_hift(model_dir)
    onnx_hift = OnnxHift(onnx_dir, hift)
    mel = torch.randn(1, 80, 160, generator=torch.Generator().manual_seed(3)) * 2 - 6

    def vocode(vocoder: object) -> torch.Tensor:
        generator, state, pcm = torch.Generator().manual_seed(11), init_hift_stream_state(), []
        for i, (a, b) in enumerate([(0, 40), (40, 100), (100, 160)]):
            pcm.append(hift_stream_step(vocoder, mel[:, :, a:b], state, i == 2, generator=generator))  # type: ignore[arg-type]
        return torch.cat(pcm)

    err = float((vocode(onnx_hift) - vocode(hift)).abs().max())
    status = "PASS" if err <= PARITY_TOL else "FAIL"
    detail = f"max |pcm err| {err:.2e} (<= {PARITY_TOL})"
    return Check("onnx HiFT decoder (onnxruntime, streamed)", status, detail)


def speed_checks(
    model_dir: Path, onnx_dir: Path, runs: int, quick: bool, device: str = "cpu"
) -> tuple[list[Check], str]:
    """Each path of this device against eager fp32 on it: speed, greedy agreement, mel error."""
    from voicertc.export.measure import CUDA_PATHS, PATHS, Workload, measure_paths

    cuda = device.startswith("cuda")
    work = Workload(llm_tokens=200, speech_tokens=250, runs=runs)
    paths: tuple[str, ...] = CUDA_PATHS if cuda else PATHS
    if quick:  # torch.compile spends minutes in the C++/Triton compilers: left out of --quick
        work = Workload(llm_tokens=20 if not cuda else 100, speech_tokens=80, runs=1)
        paths = tuple(p for p in paths if p != "compile")
    results = measure_paths(model_dir, onnx_dir, paths, work, device=device)
    # the eager fp32 row streams the same utterance a second time: its mel error is this device's
    # run-to-run floor (0 on CPU; ~1e-3 at full size on CUDA, where cuBLAS may pick other kernels and
    # 10 Euler steps with CFG amplify the last bits). Exact paths must stay within twice that floor.
    floor = next((r.max_mel_error or 0.0 for r in results if r.path == "eager fp32" and not r.error), 0.0)
    exact_tol = max(PARITY_TOL, 2 * floor)
    checks = []
    for r in results:
        name = f"path {r.path} ({device})"
        if r.error:
            checks.append(Check(name, "FAIL", r.error))
            continue
        agreement, mel = r.token_agreement or 0.0, r.max_mel_error or 0.0
        if r.path in ("bf16", "fp16", "cuda graphs bf16"):  # reduced precision: near-ties flip
            ok = agreement >= BF16_MIN_AGREEMENT and mel <= BF16_MAX_MEL_ERROR
        elif r.path == "eager fp32":  # the floor itself: deterministic enough to check against
            ok = agreement >= 0.99 and mel <= RUN_TO_RUN_MAX
        elif r.path == "compile":
            ok = agreement >= 0.99 and mel <= max(PARITY_TOL * 10, 2 * floor)
        else:  # onnx, cuda graphs (fp32): the same computation
            ok = agreement >= 0.99 and mel <= exact_tol
        detail = f"greedy agreement {agreement:.3f} over {r.tokens_compared} tokens, max |mel err| {mel:.2e}"
        if r.path == "eager fp32":
            detail += " (run-to-run floor)"
        checks.append(Check(name, "PASS" if ok else "FAIL", detail))
    from voicertc.export.report import text_table

    return checks, text_table([r.row() for r in results])


def gpu_tests() -> Check:
    tests = REPO / "tests"
    if not tests.is_dir():
        return Check("gpu pytest suite", "SKIP", "no tests/ directory (not a source checkout)")
    files = sorted(str(p) for p in tests.glob("test_gpu*.py"))  # the GPU suite: tests/test_gpu*.py
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", *files]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    return Check("gpu pytest suite", "PASS" if proc.returncode == 0 else "FAIL", last)


def gpu_table(model_dir: Path) -> str:
    """bench.cv2_load at 1/8/32 utterances: eager fp32, and the advised bf16 + CUDA graphs."""
    tables = []
    advised = ["--dtype", "bfloat16", "--cuda-graphs"]
    for label, extra in (("fp32 eager", []), ("bf16 + cuda graphs", advised)):
        cmd = [sys.executable, "-m", "bench.cv2_load", "--model-dir", str(model_dir), "--device", "cuda",
               "--concurrency", "1", "8", "32", *extra]  # fmt: skip
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
        body = proc.stdout if proc.returncode == 0 else f"bench.cv2_load failed: {proc.stderr[-800:]}"
        tables.append(f"-- {label}\n{body}")
    return "\n".join(tables)


def run_doctor(
    model_dir: str, run_tests: bool = True, runs: int = 3, quick: bool = False, out: Any = None
) -> int:
    """Print the report; exit status 0 when no check FAILed."""
    import torch

    out = out or sys.stdout
    with tempfile.TemporaryDirectory(prefix="voicertc-doctor-") as tmp:
        work = Path(tmp)
        directory = Path(model_dir)
        lines = ["voicertc doctor", "== versions", *versions(), "== device", *device_lines()]
        lines.append(f"== model {directory}")
        onnx_dir = work / "onnx"
        checks = [
            _guard("vllm export", lambda: check_vllm_export(directory, work)),
            _guard("onnx estimator", lambda: check_onnx_estimator(directory, onnx_dir)),
            _guard("onnx hift", lambda: check_onnx_hift(directory, onnx_dir)),
        ]
        cuda = torch.cuda.is_available()
        tables = []
        for device in ("cpu", "cuda") if cuda else ("cpu",):
            try:
                speed, table = speed_checks(directory, onnx_dir, runs, quick, device)
                tables += [f"== {device.upper()} paths (ms; p50/p95 over runs)", table]
            except Exception as exc:
                speed = [Check(f"speed paths ({device})", "FAIL", f"{type(exc).__name__}: {exc}"[:300])]
            checks += speed
        if quick:
            checks.append(Check("path compile", "SKIP", "--quick (torch.compile takes minutes)"))
        for name, module in (("tensorrt estimator", "tensorrt"), ("vllm runner", "vllm")):
            if not cuda:
                checks.append(Check(name, "SKIP", "no CUDA device"))
            elif importlib.util.find_spec(module) is None:
                checks.append(Check(name, "SKIP", f"{module} not installed (pip install voicertc[gpu])"))
        if not cuda:
            checks.append(Check("cuda graphs", "SKIP", "no CUDA device"))
        if cuda and run_tests:
            checks.append(gpu_tests())
        elif run_tests:
            checks.append(Check("gpu pytest suite", "SKIP", "no CUDA device"))
        lines += ["== checks", *(c.line() for c in checks), *tables]
        if cuda:
            lines += ["== GPU engine under load (bench.cv2_load)", gpu_table(directory)]
        failed = sum(c.status == "FAIL" for c in checks)
        lines.append(f"== summary: {sum(c.status == 'PASS' for c in checks)} PASS, {failed} FAIL, "
                     f"{sum(c.status == 'SKIP' for c in checks)} SKIP")  # fmt: skip
        print("\n".join(lines), file=out, flush=True)
    return 1 if failed else 0
