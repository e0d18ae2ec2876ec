"""Where a CosyVoice2 step's time goes on a GPU: decode steps by batch rows, flow + vocoder chunks captured
and eager, and torch.profiler tables of one decode step and one captured chunk (host ops vs device time).

    python -m bench.gpu_probe --model-dir .models/cv2_full --device cuda --dtype bfloat16 --out DIR

Writes DIR/gpu_probe.json (timings, p50/p95 over several runs) and DIR/profile_*.txt (the profiler's
tables, top ops by self CPU time and by device time). On CPU (`--device cpu`) it runs the same steps
uncaptured (`static_steps`), as the dry run of the GPU suite.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.cv2_stream import TRANSCRIPT
from bench.report import summary
from voicertc.backends.cosyvoice.llm.batch import decode_batch
from voicertc.backends.cosyvoice.llm.bistream import BistreamSession
from voicertc.backends.cosyvoice.llm.qwen2lm import LlmSession
from voicertc.backends.cosyvoice.load import load_v2 as load
from voicertc.backends.cosyvoice.load.files import DTYPES
from voicertc.backends.cosyvoice.serve.backend import BackendOptions, CosyVoice2Backend
from voicertc.backends.cosyvoice.serve.captured_stages import remove_captured_steps
from voicertc.backends.cosyvoice.serve.streams import token2wav_stream
from voicertc.backends.cosyvoice.voice.voices import Voice, voice_from_features
from voicertc.engine import ChunkSchedule

logger = logging.getLogger("bench.gpu_probe")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    return 1000 * (time.perf_counter() - started)


def _profile_table(fn: Callable[[], object], device: torch.device, path: Path) -> None:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    averages = prof.key_averages()
    parts = [averages.table(sort_by="self_cpu_time_total", row_limit=30)]
    if device.type == "cuda":
        parts.append(averages.table(sort_by="self_cuda_time_total", row_limit=20))
    path.write_text("\n\n".join(parts))


def probe_output(
    args: argparse.Namespace, filename: str
) -> tuple[Path, dict[str, object], Callable[[], None]]:
    """A probe's output folder (`args.out`, made), its record (the arguments first) and a `save()` that
    rewrites `filename` there (called after every phase: a cut run keeps what it measured)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, object] = {"args": vars(args)}

    def save() -> None:
        (out / filename).write_text(json.dumps(record, indent=1, default=str))

    return out, record, save


def make_voice(model: object, prompt_tokens: int = 75) -> Voice:
    gen = torch.Generator().manual_seed(11)
    return voice_from_features(
        model,  # type: ignore[arg-type]
        torch.randint(0, model.flow.cfg.vocab_size, (1, prompt_tokens), generator=gen),  # type: ignore[attr-defined]
        torch.randn(1, 2 * prompt_tokens, 80, generator=gen) - 3.0,
        torch.randn(1, 192, generator=gen),
        model.text_frontend.encode(TRANSCRIPT),  # type: ignore[attr-defined]
        voice_id="probe",
    )


def decode_probe(backend: CosyVoice2Backend, rows: int, steps: int, out: Path | None) -> dict[str, object]:
    """`steps` batched decode steps of `rows` sessions (after their prefill), each timed alone."""
    model, device = backend.model, backend.model.device
    text = list(range(100, 140))
    slots = [backend.kv.acquire() for _ in range(rows)]
    sessions: list[LlmSession | BistreamSession] = [
        model.llm.prefill(text, sampling="ras", generator=torch.Generator(device).manual_seed(i), kv=slot)
        for i, slot in enumerate(slots)
    ]
    try:
        prefill_ms = _timed(lambda: decode_batch(model.llm, sessions, backend.graphs), device)
        times = [
            _timed(lambda: decode_batch(model.llm, sessions, backend.graphs), device) for _ in range(steps)
        ]
        if out is not None:
            _profile_table(
                lambda: [decode_batch(model.llm, sessions, backend.graphs) for _ in range(5)],
                device, out / f"profile_decode_{rows}rows.txt",
            )  # fmt: skip
    finally:
        for slot in slots:
            slot.release()
    return {"rows": rows, "prefill_ms": prefill_ms, "step_ms": summary(times)}


def chunk_probe(
    backend: CosyVoice2Backend, voice: Voice, runs: int, label: str, out: Path | None
) -> dict[str, object]:
    """One utterance's chunks (first hop, then the growing hops, then the final one), `runs` times."""
    model, device = backend.model, backend.model.device
    schedule = backend.schedule
    rows: list[dict[str, float]] = []
    first = schedule.first_hop_tokens + schedule.lookahead_tokens
    pushes = [first, 50, 100, 100, 37]
    for run in range(runs):
        t2w = token2wav_stream(model, voice, schedule, pcm_to_host=backend.lane.to_host)
        gen = torch.Generator().manual_seed(run)
        times: dict[str, float] = {}
        try:
            for i, n in enumerate(pushes):
                tokens = torch.randint(0, model.flow.cfg.vocab_size, (n,), generator=gen).tolist()
                times[f"push{i}_{n}tok_ms"] = _timed(partial(t2w.push, tokens), device)
            times["final_ms"] = _timed(t2w.finish, device)
        finally:
            t2w.release()
        rows.append(times)
    if out is not None:
        t2w = token2wav_stream(model, voice, schedule, pcm_to_host=backend.lane.to_host)
        try:
            _profile_table(lambda: t2w.push([1] * first), device, out / f"profile_chunk_{label}.txt")
        finally:
            t2w.release()
    keys = list(rows[0])
    return {"label": label, "runs": rows, "p50": {k: summary([r[k] for r in rows])["p50"] for k in keys}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--out", required=True)
    parser.add_argument("--graph-rows", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    args = parser.parse_args()
    out, record, save = probe_output(args, "gpu_probe.json")

    model = load(args.model_dir, args.device, DTYPES[args.dtype])
    device = model.device
    cuda = device.type == "cuda"
    options = BackendOptions(seed=5, cuda_graphs=cuda, static_steps=not cuda, graph_rows=args.graph_rows)
    backend = CosyVoice2Backend(model, ChunkSchedule(), options=options)
    record["warm_up_ms"] = _timed(backend.warm_up, device)
    save()
    voice = make_voice(model)
    record["decode"] = [
        decode_probe(backend, r, 20, out if r in (1, max(args.rows)) else None) for r in args.rows
    ]
    save()
    logger.info("decode: %s", record["decode"])
    record["chunks_captured"] = chunk_probe(backend, voice, args.runs, "captured", out)
    save()
    logger.info("captured chunks p50: %s", record["chunks_captured"]["p50"])  # type: ignore[index]
    if backend.captured is not None:
        record["captured_stats"] = {
            name: {**vars(st), "by_shape": {str(k): n for k, n in st.by_shape.items()}}
            for name, st in backend.captured.stats().items()
        }
        remove_captured_steps(model, backend.captured)
    record["chunks_eager"] = chunk_probe(backend, voice, max(2, args.runs - 1), "eager", out)
    save()
    logger.info("eager chunks p50: %s", record["chunks_eager"]["p50"])  # type: ignore[index]
    if cuda:
        record["max_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    save()
    logger.info("wrote %s", out / "gpu_probe.json")


if __name__ == "__main__":
    main()
