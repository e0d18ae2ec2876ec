"""Loads an official Fun-CosyVoice3-0.5B model directory into our modules.

Layout: `cosyvoice3.yaml` (every hyperparameter; tags checked, nothing imported), `llm.pt`, `flow.pt`,
`hift.pt` (strict), `CosyVoice-BlankEN/` (Qwen2 `config.json` + tokenizer), `campplus.onnx`,
`speech_tokenizer_v3.onnx`, optional `spk2info.pt`. The files the networks need are checked up front and
every missing one is named in one error; a checkpoint that does not match the yaml names its file and
keys. The frontend parts a voice may never need (the two ONNX models, the tokenizer files) are opened on
first use, like CosyVoice2's, so a directory without them still loads.

The model object is CosyVoice2's (`CosyVoice2Model`, same API) with v3's networks, tokenizer and
streaming vocoder.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from voicertc.backends.cosyvoice.flow.config_v3 import FlowV3Config
from voicertc.backends.cosyvoice.flow.flow_v3 import CausalFlowV3, load_flow_v3_state_dict
from voicertc.backends.cosyvoice.hift.causal import CausalHiFTGenerator, HiftV3Config, load_hift_v3_state_dict
from voicertc.backends.cosyvoice.llm.qwen2lm import LlmConfig, build_llm
from voicertc.backends.cosyvoice.llm.v3 import COSYVOICE3LM_TAG, CosyVoice3LM
from voicertc.backends.cosyvoice.load.files import (
    BLANKEN_DIR,
    check_tags,
    cuda_settings,
    load_spk2info,
    load_weights,
    read_config,
)
from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
from voicertc.backends.cosyvoice.voice.onnx_frontends import SpeechTokenizer
from voicertc.backends.cosyvoice.voice.text_v3 import TextFrontendV3
from voicertc.errors import ModelDirError

logger = logging.getLogger(__name__)

YAML_NAME = "cosyvoice3.yaml"
SPEECH_TOKENIZER_NAME = "speech_tokenizer_v3.onnx"
REQUIRED_FILES = ("llm.pt", "flow.pt", "hift.pt", f"{BLANKEN_DIR}/config.json")
OTHER_VERSIONS = {"cosyvoice2.yaml": "CosyVoice2", "cosyvoice.yaml": "CosyVoice (v1)"}
EXPECTED_TAGS = {
    "llm": COSYVOICE3LM_TAG,
    "flow": "new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT",
    "hift": "new:cosyvoice.hifigan.generator.CausalHiFTGenerator",
}
KNOWN_OTHER_TAGS = {
    "new:cosyvoice.llm.llm.Qwen2LM": "CosyVoice2",
    "new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec": "CosyVoice2",
    "new:cosyvoice.hifigan.generator.HiFTGenerator": "CosyVoice2 / v1",
    "new:cosyvoice.llm.llm.TransformerLM": "CosyVoice (v1)",
    "new:cosyvoice.flow.flow.MaskedDiffWithXvec": "CosyVoice (v1)",
}


@dataclass
class CosyVoice3Model(CosyVoice2Model):
    """The three v3 networks of one model directory plus its lazily opened frontend parts."""

    def __post_init__(self) -> None:
        self.text_frontend = TextFrontendV3(self.model_dir / BLANKEN_DIR)

    @property
    def speech_tokenizer(self) -> SpeechTokenizer:
        if self._speech_tokenizer is None:
            path = self.model_dir / SPEECH_TOKENIZER_NAME
            if not path.is_file():
                raise ModelDirError(f"{path}: not found (needed by the CosyVoice3 frontend)")
            self._speech_tokenizer = SpeechTokenizer(path)
        return self._speech_tokenizer


def _check_directory(model_dir: Path) -> Path:
    if not model_dir.is_dir():
        raise ModelDirError(f"{model_dir}: not a directory")
    yaml_path = model_dir / YAML_NAME
    if not yaml_path.is_file():
        for name, version in OTHER_VERSIONS.items():
            if (model_dir / name).is_file():
                found = model_dir / name
                raise ModelDirError(f"{found}: this is a {version} model directory; expected {YAML_NAME}")
        raise ModelDirError(f"{yaml_path}: not found; not a CosyVoice3 model directory")
    missing = [str(model_dir / name) for name in REQUIRED_FILES if not (model_dir / name).is_file()]
    if missing:
        raise ModelDirError(f"{model_dir}: CosyVoice3 directory incomplete, missing: {', '.join(missing)}")
    return yaml_path


def build(model_dir: Path, device: torch.device, dtype: torch.dtype) -> CosyVoice3Model:
    """The networks of an official-layout CosyVoice3 directory; flow in `dtype`; LLM and HiFT in float32.

    The LLM stays float32 whatever `dtype` says: upstream's fp16/bf16 LLM produces NaNs."""
    if device.type == "cuda":
        cuda_settings(dtype)
    yaml_path = _check_directory(model_dir)
    config = read_config(model_dir, yaml_path)
    check_tags(config, yaml_path, EXPECTED_TAGS, KNOWN_OTHER_TAGS)
    llm_cfg = LlmConfig.from_yaml(config["llm"], model_dir / BLANKEN_DIR / "config.json")
    llm_path = model_dir / "llm.pt"
    llm = build_llm(llm_cfg, load_weights(llm_path), str(llm_path), device, torch.float32, cls=CosyVoice3LM)

    flow = CausalFlowV3(FlowV3Config.from_yaml(config["flow"]))
    load_flow_v3_state_dict(flow, load_weights(model_dir / "flow.pt"), str(model_dir / "flow.pt"))
    hift = CausalHiFTGenerator(HiftV3Config.from_yaml(config["hift"]))
    load_hift_v3_state_dict(hift, load_weights(model_dir / "hift.pt"), str(model_dir / "hift.pt"))

    model = CosyVoice3Model(
        model_dir=model_dir,
        config=config,
        llm=llm,
        flow=flow.to(device=device, dtype=dtype).eval(),
        hift=hift.to(device=device).eval(),  # type: ignore[arg-type]
        spk2info=load_spk2info(model_dir / "spk2info.pt"),
        device=device,
        dtype=dtype,
    )
    logger.info("loaded CosyVoice3 from %s on %s (%s), %d spk2info entries", model_dir, device, dtype,
                len(model.spk2info))  # fmt: skip
    return model
