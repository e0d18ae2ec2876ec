"""CosyVoice2 streaming engine on full-size random weights: flow cost per chunk and time to first audio.

    .venv/bin/python -m bench.make_full_model_dir      # once: .models/cv2_full (about 2.5 GB)
    .venv/bin/python -m bench.cv2_stream [--chunks 12] [--runs 3] [--device cpu]

(a) Flow cost of chunks 1..N of one long utterance with the hop fixed at 25 tokens: the incremental
    `stream_step` (caches; min of 3 timings from cloned states) beside the reference's recompute of
    the prompt and every token so far (`flow.infer` over the prefix), in the same run, with the max
    difference of the new frames. Incremental should stay flat (chunk N <= 1.3 x chunk 2). Beside
    the timings, the estimator's arithmetic per chunk (`estimator_gflop`): the dense part is
    proportional to the chunk, exact attention to chunk x context, which bounds how flat any exact
    incremental flow can be.
(b) Time to first audio through `CosyVoice2Backend.step_alone` (no worker queue): frontend, LLM prefill,
    decode to the first hop, flow and vocoder of the first chunk, for a zero-shot voice with a 3 s
    prompt (75 tokens; `--ttfa-prompt-tokens`) and a 26-token transcript. `--first-hop 13 --grid 25`
    measures the short first hop on the flow's grid (same mel, see voicertc/engine/schedule.py).
`--version 3`: (b) only, through `CosyVoice3Backend` on the full-size random v3 directory (issue 21's
TTFA parts; (a) is the v2 flow's). Prints two tables and writes bench/results/cv2_stream_<device>.json
(cv3_stream_ttfa_<device>... for v3).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.cv2_flow_chunks import timed
from bench.make_full_model_dir import DEFAULT_OUT, DEFAULT_OUT_V3, make_full_model_dir
from bench.report import summary, table, write_json
from voicertc.backends.cosyvoice.flow.flow import CausalFlow
from voicertc.backends.cosyvoice.load import load_v2 as load
from voicertc.backends.cosyvoice.load import load_v3
from voicertc.backends.cosyvoice.load.files import DTYPES
from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
from voicertc.backends.cosyvoice.load.v3 import CosyVoice3Model
from voicertc.backends.cosyvoice.serve.backend import BackendOptions, CosyVoice2Backend
from voicertc.backends.cosyvoice.serve.backend_v3 import CosyVoice3Backend
from voicertc.backends.cosyvoice.voice.voices import voice_from_features
from voicertc.engine import ChunkSchedule
from voicertc.engine.utterance import Utterance

HOP, LOOKAHEAD = 25, 3
TEXT = "The quick brown fox jumps over the lazy dog while the band plays on the square."
TRANSCRIPT = "Hello world, this is a tiny tokenizer speaking as a voice prompt for the benchmark."


def estimator_gflop(flow: CausalFlow, query_frames: int, context_frames: int) -> tuple[float, float]:
    """(dense, attention) GFLOP of one chunk's estimator work: every Euler step, both CFG rows.

    Dense: 2 FLOP per weight per frame over the per-frame linears and convs (the time MLPs run once
    per step and are left out). Attention: QK^T and AV, 4 FLOP per query, key and inner channel."""
    est = flow.decoder.estimator
    per_step_only = {id(p) for m in est.modules() if hasattr(m, "mlp") for p in m.mlp.parameters()}
    per_step_only |= {id(p) for p in est.time_mlp.parameters()}
    dense_weights = sum(
        m.weight.numel()
        for m in est.modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d)) and id(m.weight) not in per_step_only
    )
    cfg, runs = flow.cfg.estimator, 2 * flow.cfg.n_timesteps
    layers = sum(1 for m in est.modules() if type(m).__name__ == "Attention")
    inner = cfg.num_heads * cfg.attention_head_dim
    dense = 2.0 * dense_weights * query_frames * runs
    attention = 4.0 * query_frames * context_frames * inner * layers * runs
    return dense / 1e9, attention / 1e9


def flow_chunk_rows(
    flow: CausalFlow, chunks: int, prompt_tokens: int, device: str
) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(7)
    vocab, pad = flow.cfg.vocab_size, -prompt_tokens % HOP
    prompt = torch.randint(0, vocab, (1, prompt_tokens), generator=gen).to(device)
    feat = (torch.randn(1, 2 * prompt_tokens, 80, generator=gen) - 3.0).to(device)
    embedding = torch.randn(1, 192, generator=gen).to(device)
    tokens = torch.randint(0, vocab, (1, pad + HOP * chunks + LOOKAHEAD), generator=gen).to(device)
    state = flow.init_stream(prompt, feat, embedding)
    rows, offset = [], 0
    for index in range(chunks):
        end = offset + HOP + (pad if index == 0 else 0)
        piece = tokens[:, offset : end + LOOKAHEAD]
        times = [
            timed(lambda p=piece: flow.stream_step(p, state.clone(), False), device)[1] for _ in range(2)
        ]
        frames_before = state.frames
        mel, t_inc = timed(lambda p=piece: flow.stream_step(p, state, False), device)
        dense, attention = estimator_gflop(flow, state.frames - frames_before, state.frames)
        ref, t_ref = timed(
            lambda e=end: flow.infer(tokens[:, : e + LOOKAHEAD], prompt, feat, embedding, streaming=True,
                                     finalize=False),
            device,
        )  # fmt: skip
        diff = float((ref[:, :, 2 * offset :] - mel).abs().max())
        rows.append(
            {"chunk": index + 1, "end_token": end, "new_frames": mel.shape[2],
             "prefix_frames": ref.shape[2], "incremental_ms": 1e3 * min(times + [t_inc]),
             "recompute_ms": 1e3 * t_ref, "max_abs_diff": f"{diff:.1e}",
             "dense_gflop": round(dense, 1), "attention_gflop": round(attention, 1)}
        )  # fmt: skip
        offset = end
    return rows


def flatness(rows: list[dict[str, object]], last: int) -> tuple[float, float]:
    """(measured chunk `last` / chunk 2, the same ratio of the estimator's GFLOP)."""
    by_chunk = {int(r["chunk"]): r for r in rows}  # type: ignore[call-overload]

    def gflop(k: int) -> float:
        return float(by_chunk[k]["dense_gflop"]) + float(by_chunk[k]["attention_gflop"])  # type: ignore[arg-type]

    measured = float(by_chunk[last]["incremental_ms"]) / float(by_chunk[2]["incremental_ms"])  # type: ignore[arg-type]
    return measured, gflop(last) / gflop(2)


def _utterance(uid: str, voice_id: str) -> Utterance:
    now = time.monotonic()
    return Utterance(
        utterance_id=uid, voice=voice_id, sink=None, on_event=lambda e: None,  # type: ignore[arg-type]
        generation=0, opened_s=now, text=TEXT, input_ended=True, first_text_s=now,
    )  # fmt: skip


def ttfa_rows(
    model: CosyVoice2Model,
    runs: int,
    device: str,
    prompt_tokens: int,
    schedule: ChunkSchedule,
    cuda_graphs: bool = False,
    compile_steps: bool = False,
    decode_ahead: bool = True,
) -> tuple[list[dict[str, object]], float, dict[str, dict[str, int]]]:
    """TTFA parts of `runs` utterances, the voice preparation time, and the captured stages' counts
    (replays, eager fallbacks, captures: whether the runs replayed what warm-up captured)."""
    options = BackendOptions(
        seed=5, cuda_graphs=cuda_graphs, compile_steps=compile_steps, decode_ahead=decode_ahead
    )
    # the backend first and warm, as the server is before it builds a voice: the prompt context is then
    # built through the captured steps, packed once and read in place by every utterance (built before,
    # it was in the per-layer form, and each run's first chunk packed its own copy of the whole prompt)
    kind = CosyVoice3Backend if isinstance(model, CosyVoice3Model) else CosyVoice2Backend
    backend = kind(model, schedule, options=options)
    if device.startswith("cuda"):  # as the engine does before it says ready: kernels, captured buckets
        backend.warm_up()
    gen = torch.Generator().manual_seed(11)
    started = time.perf_counter()
    voice = voice_from_features(
        model,
        torch.randint(0, model.flow.cfg.vocab_size, (1, prompt_tokens), generator=gen),  # 6561 full-size
        torch.randn(1, 2 * prompt_tokens, 80, generator=gen) - 3.0,
        torch.randn(1, 192, generator=gen),
        model.text_frontend.encode(TRANSCRIPT),
        voice_id="bench",
    )
    voice_prep_s = time.perf_counter() - started
    backend.add_voice(voice, persist=False)
    rows = []
    for run in range(runs):
        utt = _utterance(f"run{run}", "bench")
        utt.backend_state = backend.begin(utt)
        started = time.perf_counter()
        while (
            (step := backend.step_alone(utt, time.monotonic())) is not None and not step.pcm and not step.done
        ):
            pass
        assert step is not None
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        ttfa_s = time.perf_counter() - started
        m = utt.metrics
        rows.append(
            {"run": run, "frontend_ms": 1e3 * m.get("frontend_s", 0), "prefill_ms": 1e3 * m["llm_prefill_s"],
             "decode_first_hop_ms": 1e3 * m.get("decode_first_hop_s", 0),
             # inside `decode_batch` (the rest of the first hop is the backend's own work around it)
             "decode_in_steps_ms": 1e3 * m.get("llm_decode_s", 0), "flow_ms": 1e3 * m.get("flow_s", 0),
             "vocoder_ms": 1e3 * m.get("vocoder_s", 0), "ttfa_ms": 1e3 * ttfa_s,
             "first_audio_ms": 1000 * sum(len(p) for p in step.pcm) / 24000,
             "tokens": len(utt.backend_state.t2w.tokens) if utt.backend_state.t2w else 0}
        )  # fmt: skip
        backend.release(utt)
    return rows, voice_prep_s, backend.captured_counts()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", type=int, choices=[2, 3], default=2, help="CosyVoice2 or 3 ((b) only)")
    parser.add_argument("--model-dir", default="", help="default: the full-size random directory")
    parser.add_argument("--chunks", type=int, default=12, help="flow chunks for (a); 0 = skip (a)")
    parser.add_argument("--prompt-tokens", type=int, default=17, help="flow prompt for (a); 75 = 3 s")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--cuda-graphs", action="store_true", help="(b) with [engine] cuda_graphs (CUDA)")
    parser.add_argument("--compile", action="store_true", help="(b) with --cuda-graphs: [engine] compile")
    parser.add_argument(
        "--no-decode-ahead",
        action="store_true",
        help="(b) with --cuda-graphs: read every decode step at once",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ttfa-prompt-tokens", type=int, default=75, help="voice prompt for (b)")
    parser.add_argument("--first-hop", type=int, default=25, help="schedule.first_hop_tokens for (b)")
    parser.add_argument("--grid", type=int, default=0, help="schedule.grid_tokens for (b); 0 = reference")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.version == 3 and args.chunks:
        parser.error("--version 3 measures (b) only: give --chunks 0")
    if not args.model_dir:
        default = DEFAULT_OUT_V3 if args.version == 3 else DEFAULT_OUT
        args.model_dir = str(make_full_model_dir(default, version=args.version))
    loader = load_v3 if args.version == 3 else load
    model = loader(args.model_dir, args.device, DTYPES[args.dtype])

    flow_rows: list[dict[str, object]] = []
    flat = floor = float("nan")
    if args.chunks >= 2:
        flow_rows = flow_chunk_rows(model.flow, args.chunks, args.prompt_tokens, args.device)
        flat, floor = flatness(flow_rows, args.chunks)
        print(table(flow_rows, list(flow_rows[0])))
        print(f"incremental chunk {args.chunks} / chunk 2 = {flat:.2f} (target <= 1.3); "
              f"estimator GFLOP ratio (exact attention's floor) = {floor:.2f}")  # fmt: skip

    schedule = ChunkSchedule(first_hop_tokens=args.first_hop, grid_tokens=args.grid or None)
    rows, voice_prep_s, captured = ttfa_rows(
        model,
        args.runs,
        args.device,
        args.ttfa_prompt_tokens,
        schedule,
        args.cuda_graphs,
        args.compile,
        decode_ahead=not args.no_decode_ahead,
    )
    if captured:
        print(f"captured stages (replays / eager / captures): {captured}")
    print(table(rows, list(rows[0])))
    print(f"voice preparation (flow prompt state + LLM prefix, once per voice): {1e3 * voice_prep_s:.0f} ms")
    ttfa = summary([float(r["ttfa_ms"]) for r in rows])  # type: ignore[arg-type]
    print(f"ttfa_ms p50 {ttfa['p50']:.0f}, p95 {ttfa['p95']:.0f}")
    record = {"args": vars(args), "flow_chunks": flow_rows, "flat_ratio": flat, "gflop_ratio": floor,
              "ttfa": rows, "ttfa_summary_ms": ttfa, "voice_prep_ms": 1e3 * voice_prep_s,
              "captured": captured}  # fmt: skip
    part = (
        f"prompt{args.prompt_tokens}" if flow_rows else f"ttfa_p{args.ttfa_prompt_tokens}_hop{args.first_hop}"
    )
    name = f"cv{args.version}_stream_{args.device.split(':')[0]}_{part}{'_compiled' if args.compile else ''}"
    name += "_stepped" if args.no_decode_ahead else ""
    print(f"wrote {write_json(name, record)}")


if __name__ == "__main__":
    main()
