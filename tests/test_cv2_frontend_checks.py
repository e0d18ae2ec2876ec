"""Start-up checks: every frontend file is opened and smoke-run at load, and a bad one is named."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from cv2_engine_helpers import build_speaking_model_dir

from voicertc.backends.cosyvoice.load import load_v2 as load
from voicertc.errors import ModelDirError

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def speaking_dir(tiny_model_dir, golden_dir, tmp_path_factory) -> Path:
    return build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("cv2_checks"))


def _clone(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for entry in src.iterdir():
        if entry.name not in skip:
            os.symlink(entry, dst / entry.name)
    return dst


def test_a_complete_directory_passes_and_opens_the_sessions_now(speaking_dir):
    model = load(speaking_dir)
    assert model._campplus is not None and model._campplus._model._session is not None
    assert model._speech_tokenizer is not None and model._speech_tokenizer._model._session is not None
    assert model.text_frontend._tokenizer is not None


@pytest.mark.parametrize("name", ["campplus.onnx", "speech_tokenizer_v2.onnx"])
def test_missing_onnx_file_is_named(speaking_dir, tmp_path, name):
    d = _clone(speaking_dir, tmp_path / "m", skip=(name,))
    with pytest.raises(ModelDirError, match=rf"{name}: not found"):
        load(d)


@pytest.mark.parametrize("name", ["campplus.onnx", "speech_tokenizer_v2.onnx"])
def test_broken_onnx_file_is_named(speaking_dir, tmp_path, name):
    d = _clone(speaking_dir, tmp_path / "m", skip=(name,))
    (d / name).write_bytes(b"\x08\x07 not an onnx graph")
    with pytest.raises(ModelDirError, match=rf"{name}: cannot load ONNX model"):
        load(d)


def test_onnx_file_with_the_wrong_model_is_named(speaking_dir, tmp_path):
    d = _clone(speaking_dir, tmp_path / "m", skip=("campplus.onnx",))
    os.symlink(speaking_dir / "speech_tokenizer_v2.onnx", d / "campplus.onnx")  # 2 inputs, not 1
    with pytest.raises(ModelDirError, match="campplus.onnx"):
        load(d)


def test_missing_tokenizer_files_are_named(speaking_dir, tmp_path):
    d = _clone(speaking_dir, tmp_path / "m", skip=("CosyVoice-BlankEN",))
    blanken = d / "CosyVoice-BlankEN"
    blanken.mkdir()
    shutil.copy(speaking_dir / "CosyVoice-BlankEN" / "config.json", blanken / "config.json")
    with pytest.raises(ModelDirError, match=r"CosyVoice-BlankEN/vocab.json: text tokenizer files not found"):
        load(d)


def test_engine_start_fails_naming_the_file(speaking_dir, tmp_path):
    from voicertc.assemble import create_engine
    from voicertc.config import Config, EngineConfig

    d = _clone(speaking_dir, tmp_path / "m", skip=("campplus.onnx",))
    engine = create_engine(Config(engine=EngineConfig(backend="cosyvoice2", model_dir=str(d), voices_dir="")))
    with pytest.raises(ModelDirError, match="campplus.onnx"):
        engine.start()
    assert not engine.running
