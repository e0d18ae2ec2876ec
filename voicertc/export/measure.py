"""Speed and deviation of each accelerated path against eager fp32 (`voicertc doctor`, bench.accel_cpu).

Paths: "eager fp32" (the exact default), "bf16" (LLM and flow in bfloat16), "compile" (torch.compile of
the compute leaves, `accel.compile_hot_modules`), "onnx" (the streaming estimator on ONNX Runtime); on
CUDA also "fp16" and "cuda graphs" / "cuda graphs bf16" (the LLM decode step replayed from a captured
graph, `decode_graphs`; its flow numbers repeat the eager flow of that dtype). Each is measured on the
same inputs in the same process, on one device (`device`; CUDA steps are timed after a synchronize):
- LLM: ms per decoded token (greedy, after the prefill), and greedy agreement: the fp32 greedy sequence
  is fed to the path token by token (teacher forcing) and the path's argmax is compared at every step;
- flow: ms per streamed chunk (hops 25+pad, 50, 100, ...) and the max |mel - mel_fp32| over the utterance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from voicertc.backends.cosyvoice.flow.flow import CausalFlow
from voicertc.backends.cosyvoice.llm.graphs import DecodeGraphs
from voicertc.backends.cosyvoice.llm.kv import SlotKV
from voicertc.backends.cosyvoice.llm.qwen2lm import Qwen2LM

logger = logging.getLogger(__name__)

PATHS = ("eager fp32", "bf16", "compile", "onnx")
CUDA_PATHS = ("eager fp32", "bf16", "fp16", "cuda graphs", "cuda graphs bf16", "compile")
LOOKAHEAD = 3


@dataclass
class PathResult:
    path: str
    llm_token_ms: list[float] = field(default_factory=list)
    flow_chunk_ms: list[float] = field(default_factory=list)
    token_agreement: float | None = None
    tokens_compared: int = 0
    max_mel_error: float | None = None
    error: str = ""

    def row(self) -> dict[str, object]:
        def pct(values: list[float], q: float) -> object:
            return float(np.percentile(values, q)) if values else ""

        return {
            "path": self.path,
            "llm ms/token p50": pct(self.llm_token_ms, 50),
            "llm ms/token p95": pct(self.llm_token_ms, 95),
            "flow ms/chunk p50": pct(self.flow_chunk_ms, 50),
            "flow ms/chunk p95": pct(self.flow_chunk_ms, 95),
            "greedy agreement": "" if self.token_agreement is None else f"{self.token_agreement:.3f}",
            "max mel err": "" if self.max_mel_error is None else f"{self.max_mel_error:.2e}",
            "note": self.error,
        }


# ---- LLM --------------------------------------------------------------------------------------------


def llm_text(llm: Qwen2LM, n_text: int = 12) -> list[int]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, min(llm.text_vocab_size, 300), (n_text,), generator=generator).tolist()


def greedy_reference(llm: Qwen2LM, tokens: int) -> list[int]:
    """fp32 greedy speech tokens (at most `tokens`) for the fixed text."""
    session = llm.prefill(llm_text(llm), sampling="greedy")
    session.max_len = max(session.max_len, tokens)
    out: list[int] = []
    while len(out) < tokens and (token := llm.step(session)) is not None:
        out.append(token)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def llm_decode(
    llm: Qwen2LM, reference: list[int], graphs: DecodeGraphs | None = None
) -> tuple[list[float], float]:
    """Teacher-forced decode of `reference`: (ms per token of each step, argmax agreement).

    With `graphs` the session decodes on a row of their pool and every one-position step is a replay."""
    device = llm.llm_decoder.weight.device
    slot = graphs.pool.acquire() if graphs is not None else None
    try:
        session = llm.prefill(llm_text(llm), sampling="greedy", kv=slot)
        session.max_len = len(reference) + 1
        times, agree = [], 0
        for token in reference:
            started = time.perf_counter()
            if graphs is not None and slot is not None and session.pending is not None:
                if session.pending.shape[1] == 1:
                    session.logits, session.pending = graphs.logits([slot], session.pending)[0], None
            llm.step(session, force=token)
            _sync(device)
            times.append(1000 * (time.perf_counter() - started))
            assert session.logits is not None
            logits = session.logits.float().clone()
            if len(session.out_tokens) - 1 < session.min_len:
                logits[6561] = -float("inf")
            agree += int(int(logits.argmax()) == token)
    finally:
        if slot is not None:
            slot.release()
    return times[1:], agree / max(1, len(reference))  # the first step includes the prefill


# ---- flow -------------------------------------------------------------------------------------------


def flow_inputs(flow: CausalFlow, speech_tokens: int = 250, prompt_tokens: int = 40) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(2)
    vocab = flow.cfg.vocab_size
    return {
        "prompt_tokens": torch.randint(0, vocab, (1, prompt_tokens), generator=generator),
        "prompt_feat": torch.randn(1, 2 * prompt_tokens, 80, generator=generator) * 2 - 6,
        "embedding": torch.randn(1, 192, generator=generator),
        "tokens": torch.randint(0, vocab, (1, speech_tokens), generator=generator),
    }


def flow_stream(flow: CausalFlow, inputs: dict[str, Tensor]) -> tuple[Tensor, list[float]]:
    """Stream the utterance chunk by chunk: (mel [1, 80, frames] fp32 on the CPU, ms per chunk)."""
    weight = next(flow.parameters())
    dtype, device = weight.dtype, weight.device
    state = flow.init_stream(
        inputs["prompt_tokens"].to(device),
        inputs["prompt_feat"].to(device, dtype),
        inputs["embedding"].to(device, dtype),
    )
    tokens = inputs["tokens"].to(device)
    grid = flow.cfg.chunk_tokens
    pad = -inputs["prompt_tokens"].shape[1] % grid
    hops = [grid + pad, 2 * grid] + [4 * grid] * 100
    offset, mels, times = 0, [], []
    for hop in hops:
        if offset + hop + LOOKAHEAD > tokens.shape[1]:
            break
        started = time.perf_counter()
        mels.append(flow.stream_step(tokens[:, offset : offset + hop + LOOKAHEAD], state, finalize=False))
        _sync(device)
        times.append(1000 * (time.perf_counter() - started))
        offset += hop
    started = time.perf_counter()
    mels.append(flow.stream_step(tokens[:, offset:], state, finalize=True))
    _sync(device)
    times.append(1000 * (time.perf_counter() - started))
    return torch.cat(mels, dim=2).float().cpu(), times


# ---- the paths ----------------------------------------------------------------------------------------


@dataclass
class Workload:
    llm_tokens: int = 200
    speech_tokens: int = 250
    runs: int = 3


def measure_paths(
    model_dir: str | Path,
    onnx_dir: str | Path | None,
    paths: tuple[str, ...] = PATHS,
    work: Workload | None = None,
    progress: Callable[[str], None] = logger.info,
    on_result: Callable[[PathResult], None] | None = None,
    device: str = "cpu",
) -> list[PathResult]:
    """Measure every path of `paths` on `model_dir` (export the ONNX estimator into `onnx_dir` if needed)."""
    from voicertc.backends.cosyvoice.load.v2 import load_llm

    work = work or Workload()
    llm32 = load_llm(model_dir, device)
    flow32 = CausalFlow.from_model_dir(model_dir).to(device).eval()
    reference = greedy_reference(llm32, work.llm_tokens)
    inputs = flow_inputs(flow32, work.speech_tokens)
    mel32, _ = flow_stream(flow32, inputs)
    results = []
    for path in paths:
        progress(f"measuring {path}")
        result = PathResult(path)
        try:
            variant = _variant(path, model_dir, onnx_dir, llm32, flow32)
            for _ in range(work.runs):
                times, agreement = llm_decode(variant.llm, reference, variant.graphs)
                result.llm_token_ms += times
                mel, chunk_times = flow_stream(variant.flow, inputs)
                result.flow_chunk_ms += chunk_times
            result.token_agreement, result.tokens_compared = agreement, len(reference)
            result.max_mel_error = float((mel - mel32).abs().max())
        except Exception as exc:  # a path that cannot run here is reported, not fatal
            logger.exception("path %s failed", path)
            result.error = f"{type(exc).__name__}: {exc}"[:160]
        finally:
            flow32.decoder.estimator_runner = None
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


@dataclass
class Variant:
    llm: Qwen2LM
    flow: CausalFlow
    graphs: DecodeGraphs | None = None


def _variant(
    path: str, model_dir: str | Path, onnx_dir: str | Path | None, llm32: Qwen2LM, flow32: CausalFlow
) -> Variant:
    from voicertc.backends.cosyvoice.load.v2 import load_llm

    device = llm32.llm_decoder.weight.device
    if path == "eager fp32":
        return Variant(llm32, flow32)
    if path in ("bf16", "fp16"):
        dtype = torch.bfloat16 if path == "bf16" else torch.float16
        flow = CausalFlow.from_model_dir(model_dir).to(device, dtype).eval()
        return Variant(load_llm(model_dir, device, dtype=dtype), flow)
    if path in ("cuda graphs", "cuda graphs bf16"):
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        llm, flow = llm32, flow32
        if path.endswith("bf16"):
            llm = load_llm(model_dir, device, dtype=torch.bfloat16)
            flow = CausalFlow.from_model_dir(model_dir).to(device, torch.bfloat16).eval()
        pool = SlotKV(llm.llm.model.model, slots=2, capacity=512)
        return Variant(llm, flow, DecodeGraphs(pool, llm.llm_decoder, max_rows=1))
    if path == "compile":
        from voicertc.backends.cosyvoice.flow.unet import FeedForward

        llm, flow = load_llm(model_dir, device), CausalFlow.from_model_dir(model_dir).to(device).eval()
        leaves = [layer.mlp for layer in llm.llm.model.model.layers]
        leaves += [m for m in flow.decoder.estimator.modules() if isinstance(m, FeedForward)]
        for module in leaves:
            module.compile(dynamic=True)
        return Variant(llm, flow)
    if path == "onnx":
        from voicertc.backends.cosyvoice.accel.onnx_export import ESTIMATOR_FILE, export_onnx
        from voicertc.backends.cosyvoice.flow.graph import GraphLayout, OnnxRuntimeEstimator

        if device.type != "cpu":
            raise ValueError("the onnx path runs ONNX Runtime's CPU provider (tensorrt is the CUDA path)")
        if onnx_dir is None:
            raise ValueError("the onnx path needs a directory for the exported graph")
        onnx_path = Path(onnx_dir) / ESTIMATOR_FILE
        if not onnx_path.is_file():
            export_onnx(model_dir, onnx_dir)
        threads = torch.get_num_threads()
        runner = OnnxRuntimeEstimator(onnx_path, GraphLayout.of(flow32.decoder.estimator), threads=threads)
        flow32.decoder.estimator_runner = runner
        return Variant(llm32, flow32)  # the LLM has no ONNX path: its numbers repeat eager fp32
    raise ValueError(f"unknown path {path!r}")
