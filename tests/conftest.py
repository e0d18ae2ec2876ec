"""Shared fixtures: where the reference vectors live, a tiny official-layout model directory."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO.parent / "shared" / "golden"


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    assert GOLDEN.is_dir(), f"reference vectors not found at {GOLDEN}"
    return GOLDEN


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, golden_dir) -> Path:
    """The tiny CosyVoice2 directory of golden/, checkpoints rebuilt with the golden tools."""
    out = tmp_path_factory.mktemp("cv2_tiny")
    shutil.copy(golden_dir / "model_dir" / "cosyvoice2.yaml", out / "cosyvoice2.yaml")
    (out / "CosyVoice-BlankEN").mkdir()
    shutil.copy(golden_dir / "model_dir" / "CosyVoice-BlankEN" / "config.json", out / "CosyVoice-BlankEN")
    subprocess.run(
        [sys.executable, str(golden_dir / "make_model_dir.py"), str(out), "--from", str(golden_dir)],
        check=True,
        capture_output=True,
    )
    return out


# --- the tiny flow and its golden records (tests/test_cv2_flow*.py) ---------------------------------


@pytest.fixture(scope="module")
def flow(tiny_model_dir):
    from voicertc.backends.cosyvoice2.flow import CausalFlow

    return CausalFlow.from_model_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def golden(golden_dir):
    from safetensors.torch import load_file

    return load_file(golden_dir / "flow_nonstream.safetensors")


@pytest.fixture(scope="module")
def tts_golden(golden_dir):
    from safetensors.torch import load_file

    return load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")
