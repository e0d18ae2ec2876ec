"""`voicertc export vllm`: the exported HF model, loaded by transformers, scores as our `Qwen2LM` does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from voicertc.backends.cosyvoice.accel.vllm_export import export_vllm, load_exported
from voicertc.backends.cosyvoice.load.v2 import load_llm

TOL = 1e-4


def _check_parity(model_dir: Path, out: Path, text: list[int], prompt_text: list[int], speech: list[int]):
    llm = load_llm(model_dir)
    expected = llm.logits(text, prompt_text, speech)[0]  # [T, 6564]
    embeds = llm.lm_input(text, prompt_text, speech)
    exported = load_exported(out)
    with torch.inference_mode():
        got = exported(inputs_embeds=embeds).logits[0]
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOL
    # speech ids fed back as ids go through speech_embedding, as our decode loop feeds them
    with torch.inference_mode():
        by_ids = exported.get_input_embeddings()(torch.tensor([speech]))
    assert torch.equal(by_ids, llm.embed_speech(speech))
    return llm, exported


def test_tiny_export_matches_llm_logits(tiny_model_dir, tmp_path):
    out = export_vllm(tiny_model_dir, tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["CosyVoice2ForCausalLM"]
    assert config["vocab_size"] == 6564 and config["tie_word_embeddings"] is False
    assert "bos_token_id" not in config and "eos_token_id" not in config
    llm, exported = _check_parity(tiny_model_dir, out, [5, 9, 17, 3], [11, 12], [1, 2, 3, 4, 500])
    assert torch.equal(exported.lm_head.bias, llm.llm_decoder.bias)


def test_export_loads_with_auto_class_and_remote_code(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = export_vllm(tiny_model_dir, tmp_path / "vllm")
    model = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True)
    assert type(model).__name__ == "CosyVoice2ForCausalLM"
    assert model.lm_head.bias is not None


def test_bfloat16_export(tiny_model_dir, tmp_path):
    out = export_vllm(tiny_model_dir, tmp_path / "vllm", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    exported = load_exported(out, dtype=torch.bfloat16)
    assert exported.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.slow
def test_full_size_export_matches_llm_logits(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.make_full_model_dir import DEFAULT_OUT, make_full_model_dir

    model_dir = make_full_model_dir(DEFAULT_OUT)  # cached under .models/ (instant once written)
    out = export_vllm(model_dir, tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == 896 and config["vocab_size"] == 6564
    _check_parity(model_dir, out, list(range(100, 140)), [7, 8, 9], list(range(0, 6561, 97)))


def test_cli_export_vllm(tiny_model_dir, tmp_path, capsys):
    from signaling.cli import main

    assert main(["export", "vllm", str(tiny_model_dir), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert main(["export", "vllm", str(tmp_path / "missing"), str(tmp_path / "o2")]) == 1
    assert "not a directory" in capsys.readouterr().err
