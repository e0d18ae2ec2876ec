"""Loading an official-layout CosyVoice2 directory, and every way a directory can be wrong."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from voicertc.backends.cosyvoice.flow.flow import CausalFlow
from voicertc.backends.cosyvoice.hift.generator import HiFTGenerator
from voicertc.backends.cosyvoice.llm.qwen2lm import Qwen2LM
from voicertc.backends.cosyvoice.load import load_v2 as load
from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
from voicertc.errors import ModelDirError

torch.set_num_threads(2)


def clone(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    """A copy of `src` made of symlinks (cheap), leaving out the names in `skip`."""
    dst.mkdir(parents=True, exist_ok=True)
    for entry in src.iterdir():
        if entry.name not in skip:
            os.symlink(entry, dst / entry.name)
    return dst


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> CosyVoice2Model:
    return load(tiny_model_dir, check_frontend=False)  # the golden directory has no frontend files


def test_loads_official_layout(model, golden_dir):
    assert isinstance(model.llm, Qwen2LM)
    assert isinstance(model.flow, CausalFlow)
    assert isinstance(model.hift, HiFTGenerator)
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert model.sft_voices == {}
    assert model.sample_rate_hz == 24000
    assert model.prompt_mel_fmax_hz == 8000
    assert model.llm.sampling_params.top_k == 25
    rec = load_file(golden_dir / "llm_tiny.safetensors")
    logits = model.llm.logits(rec["in_text"][0], rec["in_prompt_text"][0], rec["in_prompt_speech_token"][0])
    torch.testing.assert_close(logits, rec["teacher_forced_logits"], atol=1e-4, rtol=0)


def test_lazy_frontend_parts_name_the_missing_file(model):
    with pytest.raises(ModelDirError, match="speech_tokenizer_v2.onnx"):
        model.speech_tokenizer  # noqa: B018
    with pytest.raises(ModelDirError, match="campplus.onnx"):
        model.campplus  # noqa: B018
    with pytest.raises(ModelDirError, match="vocab.json"):
        model.text_frontend.encode("hello")


def test_present_onnx_files_are_opened_lazily(tiny_model_dir, tmp_path):
    d = clone(tiny_model_dir, tmp_path / "m")
    (d / "campplus.onnx").write_bytes(b"not parsed until first use")
    (d / "speech_tokenizer_v2.onnx").write_bytes(b"not parsed until first use")
    loaded = load(d, check_frontend=False)
    assert loaded.campplus is loaded.campplus
    assert loaded.speech_tokenizer is loaded.speech_tokenizer


def test_spk2info_becomes_sft_voices(tiny_model_dir, tmp_path):
    d = clone(tiny_model_dir, tmp_path / "m")
    embedding = torch.randn(1, 192)
    torch.save({"alice": {"embedding": embedding}}, d / "spk2info.pt")
    loaded = load(d, check_frontend=False)
    assert list(loaded.sft_voices) == ["alice"]
    torch.testing.assert_close(loaded.sft_voices["alice"]["embedding"], embedding)


def test_not_a_directory(tmp_path):
    with pytest.raises(ModelDirError, match="not a directory"):
        load(tmp_path / "nope")


@pytest.mark.parametrize(
    ("name", "version"), [("cosyvoice.yaml", r"CosyVoice \(v1\)"), ("cosyvoice3.yaml", r"CosyVoice3 \(v3\)")]
)
def test_other_versions_are_named(tmp_path, name, version):
    (tmp_path / name).write_text("sample_rate: 24000\n")
    with pytest.raises(ModelDirError, match=rf"{name}: this is a .*{version}.*expected cosyvoice2.yaml"):
        load(tmp_path)


def test_no_yaml(tmp_path):
    with pytest.raises(ModelDirError, match="cosyvoice2.yaml: not found"):
        load(tmp_path)


@pytest.mark.parametrize(
    ("old", "new", "key", "version"),
    [
        ("cosyvoice.llm.llm.Qwen2LM", "cosyvoice.llm.llm.CosyVoice3LM", "llm", "v3"),
        ("cosyvoice.llm.llm.Qwen2LM", "cosyvoice.llm.llm.TransformerLM", "llm", "v1"),
        ("flow.CausalMaskedDiffWithXvec", "flow.CausalMaskedDiffWithDiT", "flow", "v3"),
        ("generator.HiFTGenerator", "generator.CausalHiFTGenerator", "hift", "v3"),
    ],
)
def test_yaml_with_other_version_classes(tiny_model_dir, tmp_path, old, new, key, version):
    d = clone(tiny_model_dir, tmp_path / "m", skip=("cosyvoice2.yaml",))
    text = (tiny_model_dir / "cosyvoice2.yaml").read_text()
    assert old in text
    (d / "cosyvoice2.yaml").write_text(text.replace(old, new))
    with pytest.raises(ModelDirError, match=rf"cosyvoice2.yaml: `{key}` is !new:.*{version}.*expected !new:"):
        load(d)


@pytest.mark.parametrize("name", ["llm.pt", "flow.pt", "hift.pt"])
def test_truncated_checkpoint_names_the_file(tiny_model_dir, tmp_path, name):
    d = clone(tiny_model_dir, tmp_path / "m", skip=(name,))
    data = (tiny_model_dir / name).read_bytes()
    (d / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelDirError, match=rf"{name}: cannot read"):
        load(d)


@pytest.mark.parametrize("name", ["llm.pt", "flow.pt", "hift.pt"])
def test_missing_checkpoint_names_the_file(tiny_model_dir, tmp_path, name):
    d = clone(tiny_model_dir, tmp_path / "m", skip=(name,))
    with pytest.raises(ModelDirError, match=rf"{name}: not found"):
        load(d)


def test_checkpoint_of_another_size_names_key_and_file(tiny_model_dir, tmp_path):
    d = clone(tiny_model_dir, tmp_path / "m", skip=("llm.pt",))
    state = torch.load(tiny_model_dir / "llm.pt", weights_only=True)
    state["speech_embedding.weight"] = torch.zeros(6761, 64)  # a v3-sized table
    torch.save(state, d / "llm.pt")
    with pytest.raises(ModelDirError, match=r"llm\.pt.*speech_embedding\.weight"):
        load(d)


def test_missing_backbone_config(tiny_model_dir, tmp_path):
    d = clone(tiny_model_dir, tmp_path / "m", skip=("CosyVoice-BlankEN",))
    (d / "CosyVoice-BlankEN").mkdir()
    with pytest.raises(ModelDirError, match=r"CosyVoice-BlankEN/config.json"):
        load(d)


def test_corrupt_spk2info_is_logged_and_costs_only_its_voices(tiny_model_dir, tmp_path, caplog):
    d = clone(tiny_model_dir, tmp_path / "m")
    (d / "spk2info.pt").write_bytes(b"garbage")
    loaded = load(d, check_frontend=False)
    assert loaded.spk2info == {}
    assert any("spk2info.pt: cannot read" in r.getMessage() for r in caplog.records)
