"""The official CosyVoice2/3 token2wav streaming loop and ours, side by side on the same model directory.

    .venv/bin/python -m bench.peer_official --model-dir .models/cv2_full [--version 2|3] [--device cuda] \\
        [--dtype float32|bfloat16|float16] [--tokens 250 750] [--runs 2] [--peer ../shared/peer] \\
        [--site $PEER_SITE] [--out bench/results/peer_official]

Token2wav only: the speech tokens are given (no LLM), a 3 s prompt (75 tokens, 150 mel frames, a 192-d
embedding) and 750 speech tokens from the peer tree's seeded `make_inputs.py` (ids folded into the
flow's vocabulary for the tiny directory); `--tokens 250` is 10 s of speech, 750 is 30 s.

* The official side is *run*, never copied, in a subprocess with
  `PYTHONPATH=<site>:<peer>/stubs:<peer>/cosyvoice-ace7c47` (`../shared/peer`: the official code at
  ace7c47, its README): `--version 2` (the directory's `cosyvoice2.yaml`) the peer tree's
  `official_t2w.py` (`CosyVoice2Model`), `--version 3` (`cosyvoice3.yaml`) our
  `bench/peer_official_v3_driver.py` (`CosyVoice3Model`: the same `tts(stream=True)` calls, HiFT re-run
  over the whole mel per call; same arguments, JSON and dump). `<site>` (`--site`, default `$PEER_SITE`;
  several folders joined by `:`) holds what the official code needs beyond the project's packages
  (diffusers, hyperpyyaml, ruamel.yaml<0.19, omegaconf, antlr4 4.9.3, conformer, einops, scipy,
  lightning, ...; see the peer README; v3's DiT also x-transformers 2.11.24, einx 0.4.3, frozendict, e.g.
  `--site /work/.peer-site:/tmp/xt-site`). It times `token2wav` per chunk after one untimed 250-token
  utterance; `FP16=1` (its fp16 path) for `--dtype float16` and `bfloat16` (it has no bf16).
  `--device cpu` hides the GPUs from it (it picks CUDA whenever it sees one).
* Our side: `load(dir, device, dtype)` (v2 or v3 by the directory's yaml), `voice_from_features(...)`,
  then per utterance `token2wav_stream(model, voice, ChunkSchedule(), generator=...)` (v3:
  `Token2WavStreamV3`, incremental flow and HiFT) fed with `push` exactly the tokens
  the next chunk needs (the same exponential schedule: first hop 25 + prompt pad, then 50, 100, 100 ...)
  and `finish()`; each chunk timed from the push to its PCM on the host. One untimed 250-token
  utterance first, as the official side.
* Mel agreement of the non-final chunks (the final one differs by design: the official loop recomputes
  the utterance with full attention, ours keeps the chunk masks unless `--final-chunk reference`): max
  |official - ours| per chunk, beside each side's run-to-run floor (ours: two runs, same seed, same
  process; official: a second process, same seed).

Prints a table per token count (per chunk and the total: p50/p95 over `--runs`, the speedup of the
p50s, the mel differences) and writes `<out>/peer_official_<device>_<dtype>.json` (`..._v3.json` for
`--version 3`), the official JSON and logs, and both sides' dumps in `compare.py`'s format
(`official_<n>.pt`, `ours_<n>.pt`: `{"pcm", "mels"}`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bench.golden import REPO
from bench.report import machine, summary, table
from voicertc.backends.cosyvoice.load import load
from voicertc.backends.cosyvoice.load.files import DTYPES, model_version
from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
from voicertc.backends.cosyvoice.serve.streams import token2wav_stream
from voicertc.backends.cosyvoice.voice.voices import Voice, voice_from_features
from voicertc.engine import ChunkSchedule
from voicertc.errors import ModelDirError

logger = logging.getLogger("bench.peer_official")

DEFAULT_PEER = REPO.parent / "shared" / "peer"
DEFAULT_OUT = REPO / "bench" / "results" / "peer_official"
OFFICIAL_SEED = 1234  # official_t2w.py seeds torch's global RNG with it before each utterance
WARMUP_TOKENS = 250  # both sides: one untimed utterance of this many tokens first (official_t2w.py's)
OFFICIAL_VOCAB = 6561
V3_DRIVER = REPO / "bench" / "peer_official_v3_driver.py"  # official_t2w.py's counterpart for CosyVoice3


@dataclass
class Run:
    """One utterance of one side: per-chunk timings and the new mel frames of every chunk."""

    chunks: list[dict[str, object]]
    mels: list[Tensor] = field(default_factory=list)
    pcm: Tensor | None = None

    @property
    def total_ms(self) -> float:
        return sum(float(c["ms"]) for c in self.chunks)  # type: ignore[arg-type, misc]


# ---- inputs ---------------------------------------------------------------------------------------


def make_inputs(peer: Path, out: Path, flow_vocab: int, max_tokens: int) -> Path:
    """The peer tree's seeded inputs (run, not copied), cut to `max_tokens` speech tokens (so the
    official warm-up never runs longer than the longest measured utterance) and, for a flow with a
    smaller vocabulary (the tiny directory), every id folded into it."""
    raw = out / "inputs_make_inputs.pt"
    subprocess.run([sys.executable, str(peer / "make_inputs.py"), str(raw)], check=True, capture_output=True)
    inputs = torch.load(raw)
    if inputs["tokens"].shape[1] < max_tokens:
        raise SystemExit(f"make_inputs.py gives {inputs['tokens'].shape[1]} tokens; asked for {max_tokens}")
    inputs["tokens"] = inputs["tokens"][:, :max_tokens].contiguous()
    if flow_vocab < OFFICIAL_VOCAB:
        inputs["tokens"] %= flow_vocab
        inputs["prompt_tokens"] %= flow_vocab
    path = out / "inputs.pt"
    torch.save(inputs, path)
    return path


# ---- the official side (a subprocess of the peer tree) ------------------------------------------------


def official_script(peer: Path, version: int) -> Path:
    """The official loop's driver: the peer tree's (CosyVoice2) or ours (CosyVoice3, peer code run)."""
    return peer / "official_t2w.py" if version == 2 else V3_DRIVER


def official_env(peer: Path, site: str, device: str, dtype: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [p for p in (site, str(peer / "stubs"), str(peer / "cosyvoice-ace7c47")) if p]
    )
    env["FP16"] = "1" if dtype != "float32" else "0"
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the official model takes CUDA whenever it sees it
    elif device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
    return env


def run_official(
    args: argparse.Namespace, inputs: Path, n_tokens: int, runs: int, tag: str
) -> tuple[dict[str, object], dict[str, Tensor | list[Tensor]]]:
    """The official driver once: (its JSON, its dump of the last run {"pcm", "mels"})."""
    out: Path = args.out
    json_path, dump, log = out / f"{tag}.json", out / f"{tag}.pt", out / f"{tag}.log"
    script = official_script(args.peer, args.version)
    command = [sys.executable, str(script), str(args.model_dir), str(inputs),
               str(n_tokens), str(runs), str(json_path), str(dump)]  # fmt: skip
    env = official_env(args.peer, args.site, args.device, args.dtype)
    logger.info("official %s: %d tokens x %d runs (FP16=%s)", tag, n_tokens, runs, env["FP16"])
    started = time.perf_counter()
    with log.open("w") as log_file:
        proc = subprocess.run(command, cwd=args.peer, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                              timeout=args.official_timeout_s, check=False)  # fmt: skip
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{script.name} failed (exit {proc.returncode}); its log {log}:\n{tail}")
    logger.info("official %s done in %.1f s", tag, time.perf_counter() - started)
    return json.loads(json_path.read_text()), torch.load(dump)


# ---- our side ------------------------------------------------------------------------------------------


def our_voice(model: CosyVoice2Model, inputs: dict[str, Tensor]) -> Voice:
    """The official loop's flow prompt (no transcript: the LLM is not used here)."""
    return voice_from_features(
        model, inputs["prompt_tokens"], inputs["prompt_feat"], inputs["embedding"], voice_id="peer"
    )


def our_utterance(
    model: CosyVoice2Model,
    voice: Voice,
    tokens: Tensor,
    schedule: ChunkSchedule,
    seed: int,
    draws: torch.device | None = None,
) -> Run:
    """One streamed utterance: push exactly the tokens each chunk needs, time each push that runs a
    chunk (flow + vocoder + the PCM copy to the host), then `finish()` the final chunk. `draws`: the
    device of the vocoder's excitation draws (the engine's GPU serving mode draws them on the GPU; the
    default, the host, is the reference's bit-for-bit stream and cost 55-71 ms a chunk on the H100)."""
    generator = torch.Generator(draws or torch.device("cpu")).manual_seed(seed)
    stream = token2wav_stream(model, voice, schedule, generator=generator)
    ids, pushed, run = tokens.reshape(-1).tolist(), 0, Run([])
    while (nxt := stream.next_chunk()) is not None and pushed + nxt[0] <= len(ids):
        need = nxt[0]
        started = time.perf_counter()
        chunks = stream.push(ids[pushed : pushed + need])
        elapsed_s = time.perf_counter() - started
        pushed += need
        _record(run, chunks, elapsed_s, final=False)
    started = time.perf_counter()
    stream.add_tokens(ids[pushed:])  # fewer than the next chunk needs: they go to the final chunk
    chunks = stream.finish()
    _record(run, chunks, time.perf_counter() - started, final=True)
    return run


def _record(run: Run, chunks: list, elapsed_s: float, final: bool) -> None:
    if len(chunks) != 1:
        raise RuntimeError(f"expected one chunk per push, got {len(chunks)} (final={final})")
    chunk = chunks[0]
    run.chunks.append(
        {"frames": int(chunk.mel.shape[2]), "samples": int(len(chunk.pcm)), "ms": 1e3 * elapsed_s,
         "flow_ms": 1e3 * chunk.flow_s, "vocoder_ms": 1e3 * chunk.vocoder_s, "final": chunk.final}
    )  # fmt: skip
    run.mels.append(chunk.mel.detach().to("cpu", torch.float32))
    pcm = torch.from_numpy(np.asarray(chunk.pcm, dtype=np.float32))
    run.pcm = pcm if run.pcm is None else torch.cat([run.pcm, pcm])


# ---- comparison ----------------------------------------------------------------------------------------


def mel_diffs(a: list[Tensor], b: list[Tensor], chunks: int) -> list[float | None]:
    """Max |a - b| over each of the first `chunks` chunks' new frames (None: frame counts differ)."""
    diffs: list[float | None] = []
    for x, y in zip(a[:chunks], b[:chunks], strict=False):
        same = x.shape == y.shape
        diffs.append(float((x.float().cpu() - y.float().cpu()).abs().max()) if same else None)
    return diffs


def side_by_side(
    n_tokens: int,
    official: dict[str, object],
    official_dump: dict,
    official_again: dict | None,
    ours: list[Run],
    runs: int,
) -> tuple[list[dict[str, object]], dict[str, Any]]:
    """(table rows: one per chunk and the total, the JSON record of this token count). Timings over
    the first `runs` of ours; mel: official vs our first run, and each side's run-to-run floor."""
    off_runs: list[dict] = official["runs"]  # type: ignore[assignment]
    off_chunks: list[list[dict]] = [r["chunks"] for r in off_runs]
    n_chunks = len(off_chunks[0])
    if any(len(r.chunks) != n_chunks for r in ours) or any(len(c) != n_chunks for c in off_chunks):
        counts = {"official": [len(c) for c in off_chunks], "ours": [len(r.chunks) for r in ours]}
        raise RuntimeError(f"the two sides cut different chunks: {counts}")
    timed, non_final = ours[:runs], n_chunks - 1
    diff = mel_diffs(official_dump["mels"], ours[0].mels, non_final)
    ours_floor = mel_diffs(ours[0].mels, ours[1].mels, non_final)
    off_floor = mel_diffs(official_dump["mels"], official_again["mels"], non_final) if official_again else []

    def ours_ms(k: int, key: str = "ms") -> list[float]:
        return [float(r.chunks[k][key]) for r in timed]  # type: ignore[arg-type]

    rows: list[dict[str, object]] = []
    for k in range(n_chunks):
        off_ms, our_ms = summary([float(c[k]["ms"]) for c in off_chunks]), summary(ours_ms(k))
        rows.append(
            {"chunk": k + 1, "hop_tokens": off_chunks[0][k]["hop"], "frames": ours[0].chunks[k]["frames"],
             "final": bool(off_chunks[0][k].get("final", False)),
             "official_p50_ms": off_ms["p50"], "official_p95_ms": off_ms["p95"],
             "ours_p50_ms": our_ms["p50"], "ours_p95_ms": our_ms["p95"],
             "speedup": off_ms["p50"] / our_ms["p50"],
             "ours_flow_ms": float(np.median(ours_ms(k, "flow_ms"))),
             "ours_vocoder_ms": float(np.median(ours_ms(k, "vocoder_ms"))),
             "mel_diff": _at(diff, k), "ours_floor": _at(ours_floor, k), "official_floor": _at(off_floor, k)}
        )  # fmt: skip
    off_total, our_total = (
        summary([float(r["total_ms"]) for r in off_runs]),
        summary([r.total_ms for r in timed]),
    )
    rows.append(
        {"chunk": "total", "hop_tokens": n_tokens, "frames": sum(int(r["frames"]) for r in rows),  # type: ignore[call-overload]
         "official_p50_ms": off_total["p50"], "official_p95_ms": off_total["p95"],
         "ours_p50_ms": our_total["p50"], "ours_p95_ms": our_total["p95"],
         "speedup": off_total["p50"] / our_total["p50"]}
    )  # fmt: skip
    first_chunk = {"official": summary([float(c[0]["ms"]) for c in off_chunks]), "ours": summary(ours_ms(0))}
    mel = {
        "max_abs_diff": _max(diff),
        "ours_floor": _max(ours_floor),
        "official_floor": _max(off_floor),
        "official_mel_max_abs": _max([float(m.abs().max()) for m in official_dump["mels"][:non_final]]),
        "chunks_with_other_frames": [k + 1 for k, d in enumerate(diff) if d is None],
    }
    record = {
        "n_tokens": n_tokens, "speech_s": n_tokens / 25, "chunks": rows,
        "total_ms": {"official": off_total, "ours": our_total}, "first_chunk_ms": first_chunk,
        "speedup_total_p50": off_total["p50"] / our_total["p50"],
        "speedup_first_chunk_p50": first_chunk["official"]["p50"] / first_chunk["ours"]["p50"],
        "mel_non_final": mel, "official_runs": off_runs,
        "ours_runs": [{"chunks": r.chunks, "total_ms": r.total_ms} for r in ours],
    }  # fmt: skip
    return rows, record


def summary_line(record: dict[str, Any]) -> str:
    mel = record["mel_non_final"]
    return (
        f"speedup (official p50 / ours p50): total {record['speedup_total_p50']:.2f}x, first chunk "
        f"{record['speedup_first_chunk_p50']:.2f}x; non-final chunks' mel max |official - ours| "
        f"{_fmt(mel['max_abs_diff'])} (run-to-run floors: ours {_fmt(mel['ours_floor'])}, "
        f"official {_fmt(mel['official_floor'])})"
    )


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1e}"


def _max(values: list[float | None]) -> float | None:
    return max((v for v in values if v is not None), default=None)


def _at(values: list[float | None], k: int) -> float | str:
    if k >= len(values):
        return ""
    value = values[k]
    return "frames differ" if value is None else f"{value:.1e}"


# ---- main ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--model-dir", type=Path, required=True)
    add("--version", type=int, default=2, choices=[2, 3])
    add("--device", default="cpu", help="cpu, cuda or cuda:N (both sides)")
    add("--dtype", default="float32", choices=sorted(DTYPES), help="ours; official: fp32 or its FP16 path")
    add("--tokens", type=int, nargs="+", default=[250, 750], help="speech tokens per utterance")
    add("--runs", type=int, default=2, help="timed utterances per side and token count")
    add("--peer", type=Path, default=DEFAULT_PEER, help="the peer tree (its README)")
    add("--site", default=os.environ.get("PEER_SITE", ""),
        help="the official code's extra packages (folders joined by ':')")  # fmt: skip
    add("--out", type=Path, default=DEFAULT_OUT)
    add("--threads", type=int, default=2, help="ours (official_t2w.py sets 2 itself)")
    add("--seed", type=int, default=OFFICIAL_SEED, help="our HiFT excitation seed")
    add("--final-chunk", default="chunk_mask", choices=["chunk_mask", "reference"],
        help="ours: ChunkSchedule.final_chunk (the official last chunk is 'reference')")  # fmt: skip
    add("--official-floor", action=argparse.BooleanOptionalAction, default=True,
        help="a second official process (1 run) for the official run-to-run mel floor")  # fmt: skip
    add("--official-timeout-s", type=float, default=3600.0)
    add("--cuda-graphs", action="store_true",
        help="ours: flow and HiFT as captured static-shape steps ([engine] cuda_graphs)")  # fmt: skip
    args = parser.parse_args(argv)
    if not (args.peer / "official_t2w.py").is_file():
        parser.error(f"--peer {args.peer}: no official_t2w.py there (the peer tree, ../shared/peer)")
    try:
        version = model_version(args.model_dir)
    except ModelDirError as error:
        parser.error(str(error))
    if version != args.version:
        parser.error(f"--model-dir {args.model_dir} is not a CosyVoice{args.version} directory (--version)")
    if not args.site:
        logger.warning("no --site / $PEER_SITE: the official code's extra packages must be importable as is")
    if args.runs < 1 or min(args.tokens) < 1:
        parser.error("--runs and --tokens must be >= 1")
    args.model_dir, args.peer, args.out = args.model_dir.resolve(), args.peer.resolve(), args.out.resolve()
    args.site = os.pathsep.join(str(Path(p).resolve()) for p in args.site.split(os.pathsep) if p)
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    model = load(args.model_dir, args.device, DTYPES[args.dtype], check_frontend=False)
    if args.cuda_graphs:  # the path `[engine] cuda_graphs = true` serves (one utterance: rows 2)
        from voicertc.backends.cosyvoice.accel.captured import CudaCapture, run_eagerly
        from voicertc.backends.cosyvoice.serve.captured_stages import install_captured_steps

        capture = CudaCapture() if model.device.type == "cuda" else run_eagerly
        stages = install_captured_steps(model, 1, 0.0, capture)
    inputs_path = make_inputs(args.peer, args.out, model.flow.cfg.vocab_size, max(args.tokens))
    inputs = torch.load(inputs_path)
    schedule = ChunkSchedule(final_chunk=args.final_chunk)
    if args.cuda_graphs and model.device.type == "cuda":  # as the engine's warm-up: before the first call
        history = 2 * (max(args.tokens) + inputs["prompt_tokens"].shape[1]) + 64
        stages.warm(schedule, history, model.device, next(model.flow.parameters()).dtype)

    # official first (own processes; our model idles meanwhile), then ours in this process
    official: dict[int, tuple[dict, dict, dict | None]] = {}
    for n in args.tokens:
        result, dump = run_official(args, inputs_path, n, args.runs, f"official_{n}")
        again = None
        if args.official_floor:
            again = run_official(args, inputs_path, n, 1, f"official_{n}_again")[1]
        official[n] = (result, dump, again)

    records, started = [], time.perf_counter()
    with torch.inference_mode():
        voice = our_voice(model, inputs)
        draws = model.device if args.cuda_graphs else None  # as `[engine] cuda_graphs` serves
        our_utterance(
            model, voice, inputs["tokens"][:, :WARMUP_TOKENS], schedule, args.seed, draws
        )  # untimed
        for n in args.tokens:
            tokens = inputs["tokens"][:, :n]  # 2 runs at least: our run-to-run floor
            ours = [
                our_utterance(model, voice, tokens, schedule, args.seed, draws)
                for _ in range(max(2, args.runs))
            ]
            torch.save({"pcm": ours[0].pcm, "mels": ours[0].mels}, args.out / f"ours_{n}.pt")
            rows, record = side_by_side(n, *official[n], ours, args.runs)
            records.append(record)
            print(f"\n{n} tokens ({n / 25:.0f} s of speech), {args.device} {args.dtype}, {args.runs} runs:")
            print(table(rows, list(rows[0])))
            print(summary_line(record))
    logger.info("ours done in %.1f s", time.perf_counter() - started)
    first_off = official[args.tokens[0]][0]
    suffix = "_v3" if args.version == 3 else ""
    out = args.out / f"peer_official_{args.device.split(':')[0]}_{args.dtype}{suffix}.json"
    out.write_text(json.dumps({
        "machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
        "official": {"tree": str(args.peer), "driver": str(official_script(args.peer, args.version)),
                     "fp16": args.dtype != "float32", "torch": first_off.get("torch"),
                     "threads": first_off.get("threads")},
        "ours": {"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": args.dtype,
                 "final_chunk": args.final_chunk,
                 "cuda": torch.cuda.get_device_name() if args.device.startswith("cuda") else None},
        "results": records,
    }, indent=1))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
