"""A tiny Fun-CosyVoice3 directory the engine speaks from (noise-like audio), without weights.

    .venv/bin/python -m bench.make_tiny_model_dir --version 3 OUT
    make serve ARGS="--engine cosyvoice3 --model-dir OUT"

Written into OUT (~90 MB, a few seconds):
- `cosyvoice3.yaml`, `CosyVoice-BlankEN/config.json` of golden `cv3/model_dir/` and the golden tiny
  checkpoints (golden `cv3/make_model_dir.py`);
- the tests' tiny byte-level BPE padded to the real base layout (151643 regular entries, then
  `<|endoftext|>` 151643, `<|im_start|>`, `<|im_end|>`), so the v3 special tokens get their real ids
  (`<|endofprompt|>` = 151646, the id CosyVoice3's LLM requires) — about one text token per character;
- tiny random `speech_tokenizer_v3.onnx` / `campplus.onnx` (the CosyVoice2 tiny ones, v3 file name);
- `spk2info.pt` with one sft voice, `sft-a` (the negated golden speaker embedding).

One deliberate change to `llm.pt`, the v3 analogue of the CosyVoice2 tiny directory's eos bias (v3's
`llm_decoder` has no bias): every speech-side input embedding gets +100 in channel 0, that channel of
`llm_decoder` is zeroed except for the stop rows: row 6561 (sos, a stop id, masked below the minimum
length) reads it with weight +100, the other 199 stop rows with -100. The backbone's output then always
scores 6561 far above everything else and the other stop ids far below (not even RAS's fallback draw
over the whole softmax picks them), so generation stops exactly at the minimum length: 2 speech tokens =
80 ms per text token, as for the v2 tiny directory.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from bench.make_full_model_dir import GOLDEN, write_tiny_tokenizer
from bench.make_tiny_model_dir import SFT_VOICE, write_onnx_frontends

GOLDEN_V3 = GOLDEN / "cv3"
SPEECH_TOKEN_SIZE = 6561
STOP_ROWS = 200
REAL_BASE_REGULAR = 151643  # regular entries of the real CosyVoice-BlankEN vocabulary
MARK, READ = 100.0, 100.0


def write_checkpoints(out: Path) -> None:
    for name in ("cosyvoice3.yaml", "CosyVoice-BlankEN/config.json"):
        shutil.copyfile(GOLDEN_V3 / "model_dir" / name, out / name)
    spec = importlib.util.spec_from_file_location("cv3_make_model_dir", GOLDEN_V3 / "make_model_dir.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its make_weights is byte-identical to golden/make_weights.py
    module.make_model_dir(out, GOLDEN_V3)


def stop_at_min_len(llm_path: Path) -> None:
    """Bake the stop policy of the module docstring into llm.pt."""
    state = torch.load(llm_path, map_location="cpu", weights_only=True)
    emb, dec = state["speech_embedding.weight"], state["llm_decoder.weight"]  # [6761, H] each
    emb[:, 0] += MARK
    dec[:, 0] = 0.0
    dec[SPEECH_TOKEN_SIZE : SPEECH_TOKEN_SIZE + STOP_ROWS] = 0.0
    dec[SPEECH_TOKEN_SIZE, 0] = READ
    dec[SPEECH_TOKEN_SIZE + 1 : SPEECH_TOKEN_SIZE + STOP_ROWS, 0] = -READ  # never sampled, not even by RAS
    torch.save(state, llm_path)


def write_real_layout_tokenizer(blanken: Path) -> int:
    """The tests' tiny BPE with dummy entries up to the real base size; returns the base incl. specials."""
    small = write_tiny_tokenizer(blanken) - 3
    vocab_path = blanken / "vocab.json"
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    assert len(vocab) == small
    vocab.update({f"\u0100dummy{i}": i for i in range(small, REAL_BASE_REGULAR)})
    vocab_path.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    config_path = blanken / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    specials = [
        entry["content"]
        for _, entry in sorted(config["added_tokens_decoder"].items(), key=lambda kv: int(kv[0]))
    ]
    config["added_tokens_decoder"] = {
        str(REAL_BASE_REGULAR + i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "special": True,
        }
        for i, s in enumerate(specials)
    }
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return REAL_BASE_REGULAR + len(specials)


def write_spk2info(out: Path) -> None:
    tts = load_file(GOLDEN_V3 / "cv3_tts_stream.safetensors")
    torch.save({SFT_VOICE: {"embedding": -tts["in_embedding"][0]}}, out / "spk2info.pt")


def make_tiny_cv3_model_dir(out: Path) -> Path:
    """Write the speaking tiny v3 directory (see the module docstring) into `out`; returns `out`."""
    (out / "CosyVoice-BlankEN").mkdir(parents=True, exist_ok=True)
    write_checkpoints(out)
    stop_at_min_len(out / "llm.pt")
    write_real_layout_tokenizer(out / "CosyVoice-BlankEN")
    write_onnx_frontends(out)
    (out / "speech_tokenizer_v2.onnx").replace(out / "speech_tokenizer_v3.onnx")
    write_spk2info(out)
    return out
