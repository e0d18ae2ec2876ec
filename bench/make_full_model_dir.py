"""A full-size CosyVoice2 directory with random weights, for timing (not for listening).

    .venv/bin/python -m bench.make_full_model_dir [--out .models/cv2_full]

Official layout: `cosyvoice2.yaml` is the golden tiny yaml with every shrunk value put back to its
official value (the `# official: ...` marks, golden README §B0); `CosyVoice-BlankEN/config.json` is the
Qwen2.5-0.5B config of golden `cv2_manifest_info.json`; `llm.pt` / `flow.pt` / `hift.pt` come from the
full-size manifests with golden `make_weights` (base seeds 1 / 2 / 3, the LLM's lm_head tied to its text
embedding, README §A). The text tokenizer is the tests' tiny byte-level BPE (the real Qwen vocabulary is
not available offline), so frontend timings cover normalisation plus a small BPE. Files that already
exist are kept, so a second run is instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO.parent / "shared" / "golden"
DEFAULT_OUT = REPO / ".models" / "cv2_full"
OFFICIAL_VALUE = re.compile(r"^(\s*[A-Za-z_]+:\s*)[^#\n]*?\s*# official: (.+)$", re.MULTILINE)
RECIPES = {
    "llm": ("cv2_llm_manifest.json", {"base_seed": 1, "tied": {
        "llm.model.lm_head.weight": "llm.model.model.embed_tokens.weight"}}),
    "flow": ("cv2_flow_manifest.json", {"base_seed": 2}),
    "hift": ("cv2_hift_manifest.json", {"base_seed": 3}),
}  # fmt: skip

logger = logging.getLogger("bench.make_full_model_dir")


def full_size_yaml(tiny_yaml: str) -> str:
    """The tiny yaml with each `value  # official: X` line set back to X."""
    return OFFICIAL_VALUE.sub(lambda m: m.group(1) + m.group(2).strip(), tiny_yaml)


def write_blanken(out: Path) -> None:
    blanken = out / "CosyVoice-BlankEN"
    blanken.mkdir(parents=True, exist_ok=True)
    info = json.loads((GOLDEN / "cv2_manifest_info.json").read_text())
    (blanken / "config.json").write_text(json.dumps(info["qwen2_config"], indent=1))
    if not (blanken / "vocab.json").is_file():
        write_tiny_tokenizer(blanken)


def write_tiny_tokenizer(blanken: Path) -> None:
    """The tests' tiny byte-level BPE in the CosyVoice-BlankEN layout (vocab.json, merges.txt, ...)."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_cv2_text import write_tiny_qwen_tokenizer

    write_tiny_qwen_tokenizer(blanken)


def write_weights(out: Path) -> None:
    sys.path.insert(0, str(GOLDEN))
    import make_weights

    for part, (manifest, recipe) in RECIPES.items():
        path = out / f"{part}.pt"
        if path.is_file():
            continue
        started = time.perf_counter()
        state = make_weights.state_dict(json.loads((GOLDEN / manifest).read_text()), recipe)
        torch.save(state, path)
        del state
        logger.info("wrote %s in %.0f s", path, time.perf_counter() - started)


def make_full_model_dir(out: Path = DEFAULT_OUT) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tiny = (GOLDEN / "model_dir" / "cosyvoice2.yaml").read_text()
    (out / "cosyvoice2.yaml").write_text(full_size_yaml(tiny))
    write_blanken(out)
    write_weights(out)
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    print(make_full_model_dir(args.out))


if __name__ == "__main__":
    main()
