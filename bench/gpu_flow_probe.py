"""Where a flow chunk's time goes on a GPU, for the two questions the 2026-11-27 H100 run left open.

    python -m bench.gpu_flow_probe --model-dir .models/cv2_full --device cuda --out DIR [--rows 1 8 16]
    python -m bench.gpu_flow_probe --v3 --device cuda --out DIR

v2 (default): the FIRST flow chunks of N utterances started together on one voice, through the engine's
captured path (`CosyVoice2Backend` warm-up, bf16 + `cuda_graphs` on CUDA; the static steps uncaptured on
CPU, the dry run): the encoder part (`start_stream_batch`: token encoder of every row, now one batched
forward when the rows line up) and the Euler steps (`advance_stream`) timed apart, p50 over `--runs`; a
torch.profiler table of the largest N (top ops by host time and by device time).

`--v3`: CosyVoice3's incremental DiT flow chunk as `bench.cv3_stream` streams it (full-size random
weights, eager fp32): one utterance's chunks 0..3 (50, 100, 200, 200 frames), each timed, and a profiler
table of chunk 2 (a 200-frame chunk cost 1.25 s on the H100 against 0.2 s for 100 or 300 frames), with
cuDNN as is, off, and in benchmark mode (the grouped k=31 position convs' algorithm is the suspect).

Writes DIR/gpu_flow_probe.json and DIR/profile_*.txt.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from bench.gpu_probe import _profile_table, make_voice, probe_output
from bench.report import summary
from voicertc.backends.cosyvoice.flow.flow import FlowStreamState
from voicertc.backends.cosyvoice.load import load_v2
from voicertc.backends.cosyvoice.load.files import DTYPES
from voicertc.backends.cosyvoice.serve.backend import BackendOptions, CosyVoice2Backend
from voicertc.backends.cosyvoice.serve.streams import token2wav_stream
from voicertc.backends.cosyvoice.serve.token2wav import Token2WavStream
from voicertc.engine import ChunkSchedule

logger = logging.getLogger("bench.gpu_flow_probe")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _ms(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    _sync(device)
    started = time.perf_counter()
    out = fn()
    _sync(device)
    return 1e3 * (time.perf_counter() - started), out


def first_chunk_inputs(
    t2ws: list[Token2WavStream], token_rows: list[list[int]]
) -> tuple[list[Tensor], list[FlowStreamState]]:
    """Each stream given its first chunk's tokens: the (new tokens, flow state) lists
    `CausalFlow.start_stream_batch` takes for their first chunks together."""
    for t2w, ids in zip(t2ws, token_rows, strict=True):
        t2w.add_tokens(ids)
    plans = [t2w.plan(final=False) for t2w in t2ws]
    tokens = [p.new_tokens for p in plans if p is not None]
    states = [t2w.flow_state for t2w in t2ws if t2w.flow_state is not None]
    return tokens, states


def first_chunks(
    backend: CosyVoice2Backend, rows: int, runs: int, profile_to: Path | None
) -> dict[str, object]:
    """`runs` times: `rows` fresh streams on one voice, their first chunk's encoder part and Euler steps."""
    model, device = backend.model, backend.model.device
    voice = make_voice(model)
    schedule = backend.schedule
    first = schedule.first_hop_tokens + schedule.lookahead_tokens
    encode_ms: list[float] = []
    euler_ms: list[float] = []
    for run in range(runs + 1):  # run 0 warms this row count up (not reported)
        t2ws = [
            token2wav_stream(model, voice, schedule, pcm_to_host=backend.lane.to_host) for _ in range(rows)
        ]
        gen = torch.Generator().manual_seed(run)
        try:
            vocab = model.flow.cfg.vocab_size
            ids = [torch.randint(0, vocab, (first,), generator=gen).tolist() for _ in t2ws]
            tokens, states = first_chunk_inputs(t2ws, ids)
            with torch.inference_mode():
                took, stream = _ms(partial(model.flow.start_stream_batch, tokens, states, False), device)
                took_euler, _ = _ms(partial(model.flow.advance_stream, stream), device)  # type: ignore[arg-type]
            if run:
                encode_ms.append(took)
                euler_ms.append(took_euler)
        finally:
            for t2w in t2ws:
                t2w.release()
    if profile_to is not None:
        t2ws = [
            token2wav_stream(model, voice, schedule, pcm_to_host=backend.lane.to_host) for _ in range(rows)
        ]
        try:
            tokens, states = first_chunk_inputs(t2ws, [[1] * first for _ in t2ws])

            def whole() -> object:
                with torch.inference_mode():
                    return model.flow.advance_stream(model.flow.start_stream_batch(tokens, states, False))

            _profile_table(whole, device, profile_to)
        finally:
            for t2w in t2ws:
                t2w.release()
    return {"rows": rows, "encode_ms": summary(encode_ms), "euler_ms": summary(euler_ms)}


def v2_probe(
    args: argparse.Namespace, out: Path, record: dict[str, object], save: Callable[[], None]
) -> None:
    model = load_v2(args.model_dir, args.device, DTYPES[args.dtype])
    cuda = model.device.type == "cuda"
    options = BackendOptions(seed=5, cuda_graphs=cuda, static_steps=not cuda, graph_rows=max(args.rows))
    backend = CosyVoice2Backend(model, ChunkSchedule(), options=options)
    record["warm_up_ms"], _ = _ms(backend.warm_up, model.device)
    save()
    results = []
    for rows in args.rows:
        profile_to = out / f"profile_first_chunks_{rows}rows.txt" if rows == max(args.rows) else None
        results.append(first_chunks(backend, rows, args.runs, profile_to))
        record["first_chunks"] = results
        save()
        logger.info("first chunks of %d utterances: %s", rows, results[-1])
    if backend.captured is not None:
        record["captured_stats"] = {
            name: {**vars(st), "by_shape": {str(k): n for k, n in st.by_shape.items()}}
            for name, st in backend.captured.stats().items()
        }
    save()


def v3_probe(
    args: argparse.Namespace, out: Path, record: dict[str, object], save: Callable[[], None]
) -> None:
    from bench.cv3_stream import PROMPT_TOKENS, build  # noqa: PLC0415 - only for --v3
    from voicertc.backends.cosyvoice.flow.dit import use_matmul_convs  # noqa: PLC0415 - only for --v3

    device = torch.device(args.device)
    flow, _ = build(args.device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6561, (1, 400), generator=g).to(device)
    prompt = (
        torch.randint(0, 6561, (1, PROMPT_TOKENS), generator=g).to(device),
        (torch.randn(1, 2 * PROMPT_TOKENS, 80, generator=g) - 3.0).to(device),
        torch.randn(1, 192, generator=g).to(device),
    )
    schedule = ChunkSchedule()
    chunks: list[dict[str, object]] = []
    # the 200-frame chunks cost ~1.2 s on an H100 in eager fp32 where 300-frame re-runs cost 0.2 s:
    # the grouped k=31 position convs' cuDNN algorithm is the suspect, so each setting is timed, and
    # the convs as one batched matmul each (`use_matmul_convs`: cuBLAS, no cuDNN)
    settings = {
        "default": {},
        "cudnn_off": {"enabled": False},
        "cudnn_benchmark": {"benchmark": True},
        "conv_matmul": {},
    }
    for setting, flags in settings.items():
        use_matmul_convs(flow.decoder.estimator, setting == "conv_matmul")  # type: ignore[attr-defined]
        for run in range(2):
            with torch.backends.cudnn.flags(**flags):
                chunks += _v3_chunks(flow, tokens, prompt, schedule, setting, run, out, device)
            record["v3_chunks"] = chunks
            save()
    use_matmul_convs(flow.decoder.estimator, False)  # type: ignore[attr-defined]
    record["v3_chunks"] = chunks
    save()


def _v3_chunks(
    flow: object, tokens: torch.Tensor, prompt: tuple[torch.Tensor, ...], schedule: ChunkSchedule,
    setting: str, run: int, out: Path, device: torch.device,
) -> list[dict[str, object]]:  # fmt: skip
    from bench.cv3_stream import LOOKAHEAD, PROMPT_TOKENS  # noqa: PLC0415 - only for --v3

    state = flow.init_stream(*prompt)  # type: ignore[attr-defined]
    step = flow.stream_step  # type: ignore[attr-defined]
    start, chunks = 0, []
    for index in range(4):
        end = schedule.chunk_end_tokens(index, PROMPT_TOKENS)
        new = tokens[:, start : end + LOOKAHEAD]
        if run == 1 and index == 2:
            _profile_table(
                partial(step, new, state.clone(), finalize=False),
                device,
                out / f"profile_v3_chunk2_{setting}.txt",
            )
        took, mel = _ms(partial(step, new, state, finalize=False), device)
        frames = int(mel.shape[2])  # type: ignore[attr-defined]
        chunks.append({"setting": setting, "run": run, "chunk": index, "frames": frames, "ms": took})
        logger.info("v3 chunk %d (%s, run %d): %d frames, %.0f ms", index, setting, run, frames, took)
        start = end
    return chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--v3", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out, record, save = probe_output(args, "gpu_flow_probe.json")

    if args.v3:
        v3_probe(args, out, record, save)
    else:
        v2_probe(args, out, record, save)
    logger.info("wrote %s", out / "gpu_flow_probe.json")


if __name__ == "__main__":
    main()
