"""`voicertc doctor` on CPU: the report names versions, the device, and every check with its numbers."""

from __future__ import annotations

import io

import pytest

from voicertc.export.doctor import run_doctor


@pytest.mark.slow
@pytest.mark.timeout(1800)  # exports + four paths; minutes on a loaded 2-core machine
def test_doctor_reports_every_check_on_the_tiny_model(tiny_model_dir):
    out = io.StringIO()
    status = run_doctor(str(tiny_model_dir), run_tests=True, runs=1, quick=True, out=out)
    report = out.getvalue()
    for needed in ("== versions", "torch 2.", "onnxruntime", "vllm not installed", "cuda: not available"):
        assert needed in report
    for check in (
        "[PASS] vllm export (transformers logits): max |logit err|",
        "[PASS] onnx flow estimator (onnxruntime, streamed): max |mel err|",
        "[PASS] onnx HiFT decoder (onnxruntime, streamed)",
        "[PASS] path eager fp32 (cpu): greedy agreement 1.000",
        "(run-to-run floor)",
        "[PASS] path onnx (cpu)",
        "path bf16 (cpu)",
        "[SKIP] cuda graphs: no CUDA device",
        "[SKIP] tensorrt estimator: no CUDA device",
        "[SKIP] gpu pytest suite: no CUDA device",
    ):
        assert check in report, report
    assert "flow ms/chunk p50" in report and "== summary:" in report
    assert status == (1 if "[FAIL]" in report else 0)
