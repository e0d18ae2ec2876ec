"""CosyVoice3 frontend: the v3 prompt mel (fmax = None) and the v3 tokenizer's special-token ids."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from bench.make_tiny_cv3_model_dir import write_real_layout_tokenizer
from voicertc.backends.cosyvoice.voice.features_v3 import prompt_mel
from voicertc.backends.cosyvoice.voice.text_v3 import V3_SPECIAL_TOKENS, TextTokenizerV3, with_endofprompt


def test_prompt_mel_matches_the_v3_feat_extractor(golden_dir, cv3_records):
    wav = load_file(golden_dir / "mel_extractor.safetensors")["voice8s_wav"][None]  # [1, N] 24 kHz
    ref = cv3_records("mel_v3.safetensors")["voice8s_mel_fmaxNone"].transpose(1, 2)  # [1, T, 80]
    mel = prompt_mel(wav)
    assert mel.shape == ref.shape == (1, 400, 80)
    torch.testing.assert_close(mel.exp(), ref.exp(), rtol=0.0, atol=1e-6)
    torch.testing.assert_close(mel, ref, rtol=0.0, atol=1e-3)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TextTokenizerV3:
    blanken = tmp_path_factory.mktemp("tok3") / "CosyVoice-BlankEN"
    assert write_real_layout_tokenizer(blanken) == 151646  # the real base layout
    return TextTokenizerV3(blanken)


def test_special_token_ids_match_the_reference(tokenizer, cv3_golden_dir):
    ref = json.loads((cv3_golden_dir / "tokenizer_v3_special_tokens.json").read_text(encoding="utf-8"))
    assert [t for t, _ in ref["v3_additional_special_tokens"]] == list(V3_SPECIAL_TOKENS)
    ids = tokenizer.hf.convert_tokens_to_ids(list(V3_SPECIAL_TOKENS))
    assert ids == [i for _, i in ref["v3_additional_special_tokens"]]
    assert len(tokenizer) == ref["len_after_v3"] == 151924
    assert tokenizer.endofprompt_id == 151646
    special = [i for i in tokenizer.encode(ref["sample_text"]) if i >= ref["eos_id"]]
    assert special == ref["sample_special_ids_in_order"]
    assert "[breath]" not in tokenizer.decode(tokenizer.encode("hi[breath]"))  # skip_special_tokens


def test_zero_shot_prompt_text_gets_the_endofprompt_layout():
    assert with_endofprompt("hello") == "You are a helpful assistant.<|endofprompt|>hello"
    assert with_endofprompt("Speak slowly.<|endofprompt|>hello") == "Speak slowly.<|endofprompt|>hello"


def test_full_size_v3_directory_frontend_files(tmp_path, golden_dir, cv3_golden_dir):
    """`make_full_model_dir --version 3`'s frontend part: v3's Qwen2 config, the real vocabulary (the v3
    special ids of the reference) and the v3 speech tokenizer's file name."""
    from bench.make_full_model_dir import write_blanken

    write_blanken(tmp_path, version=3)
    config = json.loads((tmp_path / "CosyVoice-BlankEN" / "config.json").read_text())
    assert config == json.loads((golden_dir / "cv3_manifest_info.json").read_text())["qwen2_config"]
    tokenizer = TextTokenizerV3(tmp_path / "CosyVoice-BlankEN")
    ref = json.loads((cv3_golden_dir / "tokenizer_v3_special_tokens.json").read_text(encoding="utf-8"))
    assert tokenizer.hf.convert_tokens_to_ids(list(V3_SPECIAL_TOKENS)) == [
        i for _, i in ref["v3_additional_special_tokens"]
    ]
    assert (tmp_path / "speech_tokenizer_v3.onnx").is_file() and (tmp_path / "campplus.onnx").is_file()
    assert not (tmp_path / "speech_tokenizer_v2.onnx").exists()
