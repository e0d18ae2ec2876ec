"""Rotary angles stay float32 in a bfloat16 model: the DiT's (CosyVoice3 flow) and the Qwen2 LLM's.

In bfloat16 integers past 256 are not representable, so angles computed from bf16 positions or a bf16
`inv_freq` are off by radians at a few hundred frames or tokens (found by review before any bf16 GPU
run). Both must equal a float64 reference at positions 600-603 however the module was cast.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from voicertc.backends.cosyvoice.flow.dit import RotaryEmbedding
from voicertc.backends.cosyvoice.llm.qwen2lm import LlmConfig, build_llm
from voicertc.backends.cosyvoice.load.yaml_config import load_yaml

START, FRAMES = 600, 4


def reference_angles(inv_freq: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(START, START + FRAMES, dtype=torch.float64)
    return positions[:, None] * inv_freq.double()[None, :]


def test_the_dit_rotary_keeps_float32_angles_when_the_model_is_cast_to_bf16():
    holder = nn.Sequential(RotaryEmbedding(64))  # cast through a parent, as `flow.to(dtype=...)` does
    exact = holder[0].inv_freq.clone()
    holder.to(dtype=torch.bfloat16)
    rotary = holder[0]
    assert rotary.inv_freq.dtype == torch.float32
    assert torch.equal(rotary.inv_freq, exact)
    assert rotary.state_dict()["inv_freq"].dtype == torch.float32
    cos, sin = rotary.cos_sin(START, FRAMES)
    angles = reference_angles(exact).repeat_interleave(2, dim=-1)
    assert torch.allclose(cos.double(), angles.cos(), atol=1e-4)
    assert torch.allclose(sin.double(), angles.sin(), atol=1e-4)


@pytest.fixture(scope="module")
def tiny_llm_bf16(golden_dir):
    sys.path.insert(0, str(golden_dir))
    import make_weights

    node = load_yaml(golden_dir / "model_dir" / "cosyvoice2.yaml")["llm"]
    config = LlmConfig.from_yaml(node, golden_dir / "model_dir" / "CosyVoice-BlankEN" / "config.json")
    manifest = json.loads((golden_dir / "tiny_llm_manifest.json").read_text())
    recipe = json.loads((golden_dir / "tiny_llm_recipe.json").read_text())
    return build_llm(config, make_weights.state_dict(manifest, recipe), "llm.pt", dtype=torch.bfloat16)


def test_the_llm_rotary_keeps_float32_frequencies_in_a_bf16_model(tiny_llm_bf16):
    backbone = tiny_llm_bf16.llm.model.model
    assert next(tiny_llm_bf16.parameters()).dtype == torch.bfloat16
    rotary = backbone.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32
    hidden = torch.zeros(1, FRAMES, backbone.config.hidden_size, dtype=torch.bfloat16)
    positions = torch.arange(START, START + FRAMES)[None]
    cos, _ = rotary(hidden, positions)
    expected = torch.cat([reference_angles(rotary.inv_freq)] * 2, dim=-1).cos()
    assert torch.allclose(cos[0].double(), expected, atol=1e-2)  # cos is bf16 (rounded once, at the end)
