"""CosyVoice3 token2wav on full-size random weights: flow and HiFT ms per chunk, incremental vs re-run.

    .venv/bin/python -m bench.cv3_stream [--runs 3] [--seconds 30] [--chunks 1,4,8] [--device cpu]

Full-size `CausalMaskedDiffWithDiT` (22 DiT blocks, dim 1024) and `CausalHiFTGenerator` (512 channels)
are built from golden `cv3/model_dir/cosyvoice3.yaml` with the official values put back (the
`# official:` marks) and filled from golden `cv3_{flow,hift}_manifest.json` with golden `make_weights`
(base seeds 2 / 3). One utterance of `--seconds` of speech (25 tokens/s, random ids) on a 3 s prompt
(75 tokens) is streamed with the default schedule (hops 25+pad, 50, then 100 tokens):

* incremental (ours): `flow.stream_step` on the K/V caches + `hift.step` on the carried conv context;
* re-run (upstream v3): `flow.infer` over prompt + every token so far (chunk masks) and
  `hift.infer` over the whole accumulated mel, as `CosyVoice3Model.token2wav` does per chunk.

The last chunk is the final one (the remaining tokens, `finalize=True`; upstream's last call runs the flow
with full attention): at 30 s on the 75-token prompt that is chunk 8 (75 tokens). Reported per selected
chunk (0-based index) and way: flow ms, HiFT ms, p50/p95 over `--runs` runs; and
time to first audio of the token2wav part (flow + HiFT of chunk 0, LLM excluded). The re-run is timed
only at the selected chunks (its cost does not depend on earlier calls). Writes
bench/results/cv3_stream_<device>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import time
from pathlib import Path

import torch

from bench.golden import GOLDEN
from bench.make_full_model_dir import full_size_yaml
from bench.report import summary, table, write_json
from voicertc.backends.cosyvoice.flow.config_v3 import FlowV3Config
from voicertc.backends.cosyvoice.flow.flow_v3 import CausalFlowV3, load_flow_v3_state_dict
from voicertc.backends.cosyvoice.hift.causal import (
    CausalHiFTGenerator,
    HiftStreamState,
    HiftV3Config,
    load_hift_v3_state_dict,
)
from voicertc.backends.cosyvoice.load.yaml_config import load_yaml
from voicertc.engine import ChunkSchedule

PROMPT_TOKENS = 75
LOOKAHEAD = 3
WAYS = ("inc_flow", "inc_hift", "rerun_flow", "rerun_hift")
logger = logging.getLogger("bench.cv3_stream")


def _make_weights():
    spec = importlib.util.spec_from_file_location("golden_make_weights", GOLDEN / "make_weights.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(device: str) -> tuple[CausalFlowV3, CausalHiFTGenerator]:
    """Full-size flow and HiFT with random weights from the golden manifests."""
    yaml_path = Path("/tmp") / f"cv3_full_{int(time.time())}.yaml"
    yaml_path.write_text(full_size_yaml((GOLDEN / "cv3" / "model_dir" / "cosyvoice3.yaml").read_text()))
    config = load_yaml(yaml_path)
    yaml_path.unlink()
    weights = _make_weights()
    flow = CausalFlowV3(FlowV3Config.from_yaml(config["flow"]))
    manifest = json.loads((GOLDEN / "cv3_flow_manifest.json").read_text())
    load_flow_v3_state_dict(flow, weights.state_dict(manifest, {"base_seed": 2}), "cv3_flow_manifest.json")
    hift = CausalHiFTGenerator(HiftV3Config.from_yaml(config["hift"]))
    manifest = json.loads((GOLDEN / "cv3_hift_manifest.json").read_text())
    load_hift_v3_state_dict(hift, weights.state_dict(manifest, {"base_seed": 3}), "cv3_hift_manifest.json")
    return flow.to(device).eval(), hift.to(device).eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def one_run(flow, hift, tokens, prompt, chunks: set[int], device: str, out: dict, save) -> None:
    """Stream `tokens` once (incremental), then the re-runs at `chunks`; fills `out[way][chunk]` (ms)
    and calls `save()` after each phase (a long CPU run leaves partial results)."""
    prompt_tokens, prompt_feat, embedding = prompt
    schedule = ChunkSchedule()
    state = flow.init_stream(prompt_tokens, prompt_feat, embedding)
    hstate = HiftStreamState()
    history: list[torch.Tensor] = []
    ends: dict[int, int] = {}
    start, index, final = 0, 0, False
    while not final and index <= max(chunks):
        end = schedule.chunk_end_tokens(index, PROMPT_TOKENS)
        final = end + LOOKAHEAD > tokens.shape[1]  # the rest of the tokens: the final chunk
        end = tokens.shape[1] if final else end
        _sync(device)
        t0 = time.perf_counter()
        new = tokens[:, start : end if final else end + LOOKAHEAD]
        mel = flow.stream_step(new, state, finalize=final)
        _sync(device)
        t1 = time.perf_counter()
        hift.step(mel, hstate, final=final)
        _sync(device)
        t2 = time.perf_counter()
        out["inc_flow"].setdefault(index, []).append(1e3 * (t1 - t0))
        out["inc_hift"].setdefault(index, []).append(1e3 * (t2 - t1))
        history.append(mel)
        ends[index] = end
        logger.info(
            "chunk %d%s: %d frames, flow %.0f ms, HiFT %.0f ms",
            index,
            " (final)" if final else "",
            mel.shape[2],
            1e3 * (t1 - t0),
            1e3 * (t2 - t1),
        )
        start, index = end, index + 1
    del state, hstate  # the re-runs below hold their own caches
    save()
    for chunk in sorted(c for c in chunks if c in ends):
        mel_so_far = torch.cat(history[: chunk + 1], dim=2)
        last = final and chunk == index - 1  # upstream's last call: full attention, finalize
        upto = ends[chunk] if last else ends[chunk] + LOOKAHEAD
        t0 = time.perf_counter()
        flow.infer(tokens[:, :upto], *prompt, streaming=not last, finalize=last)
        _sync(device)
        t1 = time.perf_counter()
        hift.infer(mel_so_far, finalize=last)
        _sync(device)
        t2 = time.perf_counter()
        out["rerun_flow"].setdefault(chunk, []).append(1e3 * (t1 - t0))
        out["rerun_hift"].setdefault(chunk, []).append(1e3 * (t2 - t1))
        logger.info(
            "re-run at chunk %d (%d frames): flow %.0f ms, HiFT %.0f ms",
            chunk,
            mel_so_far.shape[2],
            1e3 * (t1 - t0),
            1e3 * (t2 - t1),
        )
        save()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--chunks", default="1,4,8")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    chunks = {int(c) for c in args.chunks.split(",")}
    started = time.perf_counter()
    flow, hift = build(args.device)
    logger.info("built full-size flow + HiFT in %.0f s", time.perf_counter() - started)
    g = torch.Generator().manual_seed(0)
    n = int(args.seconds * 25)
    tokens = torch.randint(0, 6561, (1, n), generator=g).to(args.device)
    prompt = (
        torch.randint(0, 6561, (1, PROMPT_TOKENS), generator=g).to(args.device),
        (torch.randn(1, 2 * PROMPT_TOKENS, 80, generator=g) - 3.0).to(args.device),
        torch.randn(1, 192, generator=g).to(args.device),
    )
    out: dict[str, dict[int, list[float]]] = {k: {} for k in WAYS}

    def save() -> None:
        rows, record = report(out, chunks, args)
        print(table(rows, ["chunk"] + [f"{k}_{p}" for k in WAYS for p in ("p50", "p95")]), flush=True)
        print(write_json(f"cv3_stream_{args.device.replace(':', '')}", record), flush=True)

    for _ in range(args.runs):
        one_run(flow, hift, tokens, prompt, chunks, args.device, out, save)


def report(
    out: dict[str, dict[int, list[float]]], chunks: set[int], args: argparse.Namespace
) -> tuple[list, dict]:
    rows: list[dict[str, object]] = []
    record: dict[str, object] = {
        "seconds": args.seconds,
        "prompt_tokens": PROMPT_TOKENS,
        "threads": args.threads,
    }
    for chunk in sorted(chunks):
        row: dict[str, object] = {"chunk": chunk}
        for key in WAYS:
            values = out[key].get(chunk)
            if values:
                stats = summary(values)
                row[f"{key}_p50"], row[f"{key}_p95"] = stats["p50"], stats["p95"]
                record[f"chunk{chunk}_{key}_ms"] = stats
        rows.append(row)
    if 0 in out["inc_flow"]:
        ttfa = [f + h for f, h in zip(out["inc_flow"][0], out["inc_hift"][0], strict=False)]
        record["ttfa_token2wav_ms"] = summary(ttfa)
        rows.append(
            {"chunk": "TTFA(0)", "inc_flow_p50": summary(ttfa)["p50"], "inc_flow_p95": summary(ttfa)["p95"]}
        )
    return rows, record


if __name__ == "__main__":
    main()
