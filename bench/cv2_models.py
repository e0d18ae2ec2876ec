"""CosyVoice2 full-size models on this machine: flow ms per call, HiFT ms per audio second, LLM ms per token.

    .venv/bin/python -m bench.cv2_models [--runs 5] [--threads 2] [--parts flow,hift,llm]

Full-size modules (FlowConfig / HiftConfig full_size, the Qwen2 backbone of cv2_manifest_info.json) with
random weights drawn in memory from the golden manifests + recipes (make_weights) and loaded through the
strict project loaders; nothing is written to disk but the JSON. Every case runs once to warm up, then
`--runs` times; p50/p95 are over those runs. Flow: a 75-token (3 s) prompt, then 1 s / 2 s of new audio,
both incrementally (init_stream + stream_step of 25+3 / 50+3 tokens, chunk masks) and as the reference
recomputes it (infer(streaming=True) over prompt + new tokens). HiFT: whole-call infer on 1 s / 2 s mels
and the steady-state streaming step. LLM: prefill of a 60-token input, then 30 decode steps (RAS).
CUDA fp32/fp16 rows run when torch.cuda.is_available(), else they are listed as skipped. On a shared
2-core machine other processes make torch's worker threads wait for each other: compare `min` as well
as p50/p95, and see the load average recorded per part.
Prints a table; writes bench/results/cv2_models.json.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import resource
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from bench.cv2_flow_chunks import GOLDEN, timed
from bench.cv2_flow_chunks import build as build_flow_fp32
from bench.report import summary, table, write_json
from voicertc.backends.cosyvoice.flow.flow import CausalFlow, FlowStreamState
from voicertc.backends.cosyvoice.hift.generator import HiftConfig, HiFTGenerator
from voicertc.backends.cosyvoice.hift.stream import hift_stream_step, init_hift_stream_state
from voicertc.backends.cosyvoice.hift.weights import load_hift_state_dict
from voicertc.backends.cosyvoice.llm.qwen2lm import LlmConfig, Qwen2LM, build_llm

TOKEN_HZ, MEL_HZ = 25, 50
PROMPT_TOKENS = 75  # 3 s
LOOKAHEAD_TOKENS = 3
NEW_AUDIO_S = (1, 2)
LLM_RECIPE = {"base_seed": 1, "tied": {"llm.model.lm_head.weight": "llm.model.model.embed_tokens.weight"}}
HIFT_RECIPE = {"base_seed": 3}
PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16}

Row = dict[str, Any]


def golden_weights(manifest_name: str, recipe: dict[str, Any]) -> dict[str, Tensor]:
    sys.path.insert(0, str(GOLDEN))
    import make_weights

    return make_weights.state_dict(json.loads((GOLDEN / manifest_name).read_text()), recipe)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def measure(setup: Callable[[], Any], call: Callable[[Any], Any], runs: int, device: str) -> list[float]:
    """ms of `call(setup())` for `runs` calls after one warm-up; `setup` is not timed."""
    samples = []
    for i in range(runs + 1):
        arg = setup()
        _, seconds = timed(lambda a=arg: call(a), device)
        if i > 0:
            samples.append(1e3 * seconds)
    return samples


def row(model: str, case: str, ms: list[float], audio_s: float | None = None, unit: str = "ms/call") -> Row:
    stats = summary(ms)
    out: Row = {"model": model, "case": case, "unit": unit, "runs": stats["n"],
                "p50": stats["p50"], "p95": stats["p95"], "min": stats["min"], "stats": stats}  # fmt: skip
    if audio_s is not None:
        out["audio_s"] = audio_s
        out["p50 ms/audio s"] = stats["p50"] / audio_s
        out["p95 ms/audio s"] = stats["p95"] / audio_s
    return out


# ---------------------------------------------------------------------------------------------- flow
def flow_rows(flow: CausalFlow, runs: int, device: str, dtype: torch.dtype) -> list[Row]:
    gen = torch.Generator().manual_seed(7)
    vocab = flow.cfg.vocab_size
    prompt = torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=gen).to(device)
    feat = (torch.randn(1, 2 * PROMPT_TOKENS, 80, generator=gen) - 3.0).to(device, dtype)
    embedding = torch.randn(1, 192, generator=gen).to(device, dtype)
    tokens = torch.randint(0, vocab, (1, max(NEW_AUDIO_S) * TOKEN_HZ + LOOKAHEAD_TOKENS), generator=gen)
    prompt_state = flow.init_stream(prompt, feat, embedding)
    init_ms = measure(lambda: None, lambda _: flow.init_stream(prompt, feat, embedding), 1, device)
    rows = [row("flow", f"init_stream {PROMPT_TOKENS}-token prompt (once per voice)", init_ms)]
    for audio_s in NEW_AUDIO_S:
        chunk = tokens[:, : audio_s * TOKEN_HZ + LOOKAHEAD_TOKENS].to(device)
        frames = audio_s * MEL_HZ

        def incremental(state: FlowStreamState, c: Tensor = chunk, n: int = frames) -> Tensor:
            return check_mel(flow.stream_step(c, state, finalize=False), n)

        def recompute(_: None, c: Tensor = chunk, n: int = frames) -> Tensor:
            return check_mel(flow.infer(c, prompt, feat, embedding, streaming=True, finalize=False), n)

        new = f"{audio_s * TOKEN_HZ}+{LOOKAHEAD_TOKENS}"
        step_ms = measure(prompt_state.clone, incremental, runs, device)
        rows.append(row("flow", f"stream_step {new} after init_stream", step_ms, audio_s))
        ref_ms = measure(lambda: None, recompute, runs, device)
        rows.append(row("flow", f"infer(streaming) prompt + {new}", ref_ms, audio_s))
    return rows


def check_mel(mel: Tensor, frames: int) -> Tensor:
    if mel.shape != (1, 80, frames):
        raise RuntimeError(f"flow returned mel {list(mel.shape)}, expected [1, 80, {frames}]")
    return mel


def build_flow(device: str, dtype: torch.dtype) -> CausalFlow:
    return build_flow_fp32(full=True, device=device).to(dtype)


# ---------------------------------------------------------------------------------------------- HiFT
def build_hift(device: str, dtype: torch.dtype) -> HiFTGenerator:
    hift = HiFTGenerator(HiftConfig.full_size())
    manifest = "cv2_hift_manifest.json"
    load_hift_state_dict(hift, golden_weights(manifest, HIFT_RECIPE), manifest)
    return hift.to(device, dtype).eval()


def hift_rows(hift: HiFTGenerator, runs: int, device: str, dtype: torch.dtype) -> list[Row]:
    gen = torch.Generator().manual_seed(11)
    mels = {s: (torch.randn(1, 80, s * MEL_HZ, generator=gen) - 4.0).to(device, dtype) for s in NEW_AUDIO_S}
    rows = []
    for audio_s, mel in mels.items():
        ms = measure(lambda: None, lambda _, m=mel: hift.infer(m, generator=gen), runs, device)
        rows.append(row("hift", f"infer {audio_s * MEL_HZ} frames", ms, audio_s))
    primed = init_hift_stream_state()  # steady state: caches and held-back tail from a previous 1 s chunk
    hift_stream_step(hift, mels[1], primed, finalize=False, generator=gen)
    for audio_s, mel in mels.items():
        ms = measure(
            lambda: copy.copy(primed),
            lambda s, m=mel: hift_stream_step(hift, m, s, finalize=False, generator=gen),
            runs, device,
        )  # fmt: skip
        rows.append(row("hift", f"hift_stream_step {audio_s * MEL_HZ} frames (+8 cached)", ms, audio_s))
    return rows


# ---------------------------------------------------------------------------------------------- LLM
def build_full_llm(device: str, dtype: torch.dtype) -> Qwen2LM:
    info = json.loads((GOLDEN / "cv2_manifest_info.json").read_text())
    config = LlmConfig(qwen2=info["qwen2_config"])
    weights = golden_weights("cv2_llm_manifest.json", LLM_RECIPE)
    return build_llm(config, weights, "cv2_llm_manifest.json", device=device, dtype=dtype)


def llm_rows(llm: Qwen2LM, runs: int, device: str, decode_steps: int = 30) -> list[Row]:
    """Input = sos + 10 prompt text + 20 text + task_id + 28 prompt speech = 60 embeddings."""
    gen = torch.Generator().manual_seed(5)
    prompt_text = torch.randint(0, 151_643, (10,), generator=gen).tolist()
    text = torch.randint(0, 151_643, (20,), generator=gen).tolist()
    prompt_speech = torch.randint(0, 6561, (28,), generator=gen).tolist()
    prefill_ms, per_token_ms, all_steps_ms, steps_done = [], [], [], []
    for i in range(runs + 1):
        session = llm.prefill(text, prompt_text, prompt_speech, generator=torch.Generator().manual_seed(i))
        _, first_s = timed(lambda s=session: llm.step(s), device)  # feeds the 60 inputs, samples token 1
        step_ms = []
        for _ in range(decode_steps):
            token, seconds = timed(lambda s=session: llm.step(s), device)
            if token is None:  # a stop id was sampled (random weights): keep what was decoded
                break
            step_ms.append(1e3 * seconds)
        if i > 0 and step_ms:
            prefill_ms.append(1e3 * first_s)
            per_token_ms.append(sum(step_ms) / len(step_ms))
            all_steps_ms += step_ms
            steps_done.append(len(step_ms))
    decode = row("llm", f"decode ms/token ({decode_steps} steps, RAS)", per_token_ms, unit="ms/token")
    decode["steps_per_run"] = steps_done
    decode["per_step_stats"] = summary(all_steps_ms)
    return [row("llm", "prefill 60 tokens (+ first token)", prefill_ms), decode]


# ---------------------------------------------------------------------------------------------- driver
PARTS: dict[str, tuple[Callable[[str, torch.dtype], torch.nn.Module], Callable[..., list[Row]]]] = {
    "flow": (build_flow, lambda m, runs, device, dtype: flow_rows(m, runs, device, dtype)),
    "hift": (build_hift, lambda m, runs, device, dtype: hift_rows(m, runs, device, dtype)),
    "llm": (build_full_llm, lambda m, runs, device, dtype: llm_rows(m, runs, device)),
}


def targets() -> list[tuple[str, str, str | None]]:
    """(device, precision, reason skipped or None)."""
    cuda = None if torch.cuda.is_available() else "skipped: torch.cuda.is_available() is False"
    return [("cpu", "fp32", None), ("cuda", "fp32", cuda), ("cuda", "fp16", cuda)]


def run_part(part: str, device: str, precision: str, runs: int) -> tuple[list[Row], dict[str, Any]]:
    """Build one model, bench it, free it; also returns build time, size, peak RSS and load average."""
    build, bench = PARTS[part]
    dtype = PRECISIONS[precision]
    load_before = os.getloadavg()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model, build_s = timed(lambda: build(device, dtype), device)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    rows = bench(model, runs, device, dtype)
    info = {"build_s": build_s, "parameters": params, "peak_rss_gib_so_far": peak_rss_gib(),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()}  # fmt: skip
    if device == "cuda":
        info["cuda_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del model
    gc.collect()
    return rows, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parts", default="flow,hift,llm")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, parts = [], {}
    for device, precision, skipped in targets():
        for part in args.parts.split(","):
            where = {"device": device, "dtype": precision}
            if skipped:
                rows.append({**where, "model": part, "case": skipped})
                continue
            key = f"{part}/{device}/{precision}"
            try:
                part_rows, parts[key] = run_part(part, device, precision, args.runs)
            except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:  # e.g. no fp16 kernel
                if device == "cpu":
                    raise
                part_rows = [{"model": part, "case": f"failed: {exc}"[:200]}]
            rows += [{**where, **r} for r in part_rows]
            print(f"{key}: {parts.get(key)}", flush=True)
    columns = ["device", "dtype", "model", "case", "runs", "unit", "p50", "p95", "min", "p50 ms/audio s",
               "p95 ms/audio s"]  # fmt: skip
    print(table([{k: v for k, v in r.items() if k in columns} for r in rows], columns))
    path = write_json("cv2_models", {"args": vars(args), "parts": parts, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
