"""CosyVoice3 loader: the official directory layout, strict checkpoints, every missing or mismatched
file named, other versions recognised."""

from __future__ import annotations

import shutil

import pytest
import torch

from voicertc.backends.cosyvoice3 import CosyVoice3Model, load
from voicertc.errors import ModelDirError


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_loads_the_tiny_official_directory(cv3_model, tiny_cv3_model_dir):
    assert isinstance(cv3_model, CosyVoice3Model)
    assert cv3_model.sample_rate_hz == 24000
    assert cv3_model.prompt_mel_fmax_hz is None  # v3 feat_extractor: fmax = None
    assert cv3_model.flow.cfg.chunk_tokens == 25 and cv3_model.flow.cfg.estimator.depth == 2
    assert cv3_model.hift.f0_predictor.classifier.weight.dtype == torch.float64
    assert next(cv3_model.llm.parameters()).dtype == torch.float32
    assert cv3_model.spk2info == {}


def test_every_missing_file_is_named(tiny_cv3_model_dir, tmp_path):
    model_dir = _copy(tiny_cv3_model_dir, tmp_path / "m")
    (model_dir / "llm.pt").unlink()
    (model_dir / "hift.pt").unlink()
    with pytest.raises(ModelDirError) as err:
        load(model_dir)
    assert "llm.pt" in str(err.value) and "hift.pt" in str(err.value) and "flow.pt" not in str(err.value)


def test_missing_yaml_and_other_versions(tmp_path, golden_dir):
    with pytest.raises(ModelDirError, match="cosyvoice3.yaml"):
        load(tmp_path)
    (tmp_path / "cosyvoice2.yaml").write_text("x: 1\n")
    with pytest.raises(ModelDirError, match="CosyVoice2 model directory"):
        load(tmp_path)


def test_a_mismatched_checkpoint_names_file_and_keys(tiny_cv3_model_dir, tmp_path):
    model_dir = _copy(tiny_cv3_model_dir, tmp_path / "m")
    state = torch.load(model_dir / "flow.pt", weights_only=True)
    del state["decoder.estimator.proj_out.bias"]
    state["pre_lookahead_layer.conv1.weight"] = torch.zeros(3, 80, 4)
    torch.save(state, model_dir / "flow.pt")
    with pytest.raises(ModelDirError) as err:
        load(model_dir)
    text = str(err.value)
    assert "flow.pt" in text and "proj_out.bias" in text and "pre_lookahead_layer.conv1.weight" in text


def test_a_v2_class_in_the_yaml_is_named(tiny_cv3_model_dir, tmp_path):
    model_dir = _copy(tiny_cv3_model_dir, tmp_path / "m")
    yaml = (model_dir / "cosyvoice3.yaml").read_text()
    (model_dir / "cosyvoice3.yaml").write_text(
        yaml.replace(
            "cosyvoice.hifigan.generator.CausalHiFTGenerator", "cosyvoice.hifigan.generator.HiFTGenerator"
        )
    )
    with pytest.raises(ModelDirError, match="hift.*CosyVoice2"):
        load(model_dir)


def test_frontend_files_are_named_when_first_needed(cv3_model):
    with pytest.raises(ModelDirError, match="speech_tokenizer_v3.onnx"):
        _ = cv3_model.speech_tokenizer
    with pytest.raises(ModelDirError, match="campplus.onnx"):
        _ = cv3_model.campplus
