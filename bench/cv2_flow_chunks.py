"""CosyVoice2 flow, per-chunk cost: incremental `stream_step` vs the reference recompute of the prefix.

    .venv/bin/python -m bench.cv2_flow_chunks [--tokens 600] [--full] [--device cuda]

Random weights (golden make_weights: the tiny flow, or the full-size manifest with --full), a 17-token
prompt, hops 25 -> 50 -> 100 with the grid pad. Both paths produce the same chunks (checked); prints
one row per chunk and writes bench/results/cv2_flow_chunks.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.golden import GOLDEN
from bench.report import table, write_json
from voicertc.backends.cosyvoice.flow.config import FlowConfig
from voicertc.backends.cosyvoice.flow.flow import CausalFlow, load_flow_state_dict
from voicertc.backends.cosyvoice.load.yaml_config import load_yaml


def build(full: bool, device: str) -> CausalFlow:
    sys.path.insert(0, str(GOLDEN))
    import make_weights

    if full:
        cfg, manifest, recipe = FlowConfig.full_size(), "cv2_flow_manifest.json", {"base_seed": 2}
    else:
        cfg = FlowConfig.from_yaml(load_yaml(GOLDEN / "model_dir" / "cosyvoice2.yaml")["flow"])
        manifest = "tiny_flow_manifest.json"
        recipe = json.loads((GOLDEN / "tiny_flow_recipe.json").read_text())
    flow = CausalFlow(cfg)
    weights = make_weights.state_dict(json.loads((GOLDEN / manifest).read_text()), recipe)
    load_flow_state_dict(flow, weights, manifest)
    return flow.to(device).eval()


def timed(fn, device: str) -> tuple[torch.Tensor, float]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flow = build(args.full, args.device)
    gen = torch.Generator().manual_seed(7)
    vocab = flow.cfg.vocab_size
    prompt = torch.randint(0, vocab, (1, 17), generator=gen)
    feat = torch.randn(1, 34, 80, generator=gen) - 3.0
    embedding = torch.randn(1, 192, generator=gen)
    tokens = torch.randint(0, vocab, (1, args.tokens), generator=gen)
    state = flow.init_stream(prompt, feat, embedding)
    rows, offset, index = [], 0, 0
    while True:
        hop = min(100, 25 * 2**index) + (-17 % 25 if index == 0 else 0)
        final = offset + hop + 3 > args.tokens
        piece = tokens[:, offset:] if final else tokens[:, offset : offset + hop + 3]
        inc, t_inc = timed(lambda p=piece, f=final: flow.stream_step(p, state, finalize=f), args.device)
        end = args.tokens if final else offset + hop + 3

        def recompute(e: int = end, f: bool = final) -> torch.Tensor:
            return flow.infer(tokens[:, :e], prompt, feat, embedding, streaming=True, finalize=f)

        ref, t_ref = timed(recompute, args.device)
        diff = float((ref[:, :, 2 * offset :] - inc).abs().max())
        rows.append(
            {"chunk": index, "end_token": end, "new_frames": inc.shape[2], "incremental_ms": 1e3 * t_inc,
             "recompute_ms": 1e3 * t_ref, "max_abs_diff": f"{diff:.1e}"}
        )  # fmt: skip
        if final:
            break
        offset, index = offset + hop, index + 1
    columns = ["chunk", "end_token", "new_frames", "incremental_ms", "recompute_ms", "max_abs_diff"]
    print(table(rows, columns))
    name = "cv2_flow_chunks" + ("_full" if args.full else "") + f"_{args.device.split(':')[0]}"
    path = write_json(name, {"args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
