"""Loads an official CosyVoice2 model directory (cosyvoice.md §1) into our modules.

Reads `cosyvoice2.yaml` for every hyperparameter (tags are checked, nothing is imported), then
`llm.pt`, `flow.pt`, `hift.pt` strictly, `CosyVoice-BlankEN/config.json` for the Qwen2 backbone and the
optional `spk2info.pt` (its entries are turned into voices by `voices.VoiceBook`, each on its own: a bad
entry disables that voice, never the engine). `voice.frontend_checks` (run by `load.load` unless told
not to) opens and smoke-runs every frontend file — the text tokenizer, `campplus.onnx`,
`speech_tokenizer_v2.onnx` —
so a missing or broken one stops the start with a ModelDirError naming the file, instead of failing the
first speak or the first voice registration.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from voicertc.backends.cosyvoice.flow.config import FlowConfig
from voicertc.backends.cosyvoice.flow.flow import CausalFlow, load_flow_state_dict
from voicertc.backends.cosyvoice.hift.generator import HiftConfig, HiFTGenerator
from voicertc.backends.cosyvoice.hift.weights import load_hift_state_dict
from voicertc.backends.cosyvoice.llm.qwen2lm import QWEN2LM_TAG, LlmConfig, Qwen2LM, build_llm
from voicertc.backends.cosyvoice.load.files import (
    BLANKEN_DIR,
    check_tags,
    cuda_settings,
    load_spk2info,
    load_weights,
    read_config,
    required,
)
from voicertc.backends.cosyvoice.voice.onnx_frontends import CampPlus, SpeechTokenizer
from voicertc.backends.cosyvoice.voice.text import TextFrontend
from voicertc.errors import ModelDirError

logger = logging.getLogger(__name__)

YAML_NAME = "cosyvoice2.yaml"
SPEECH_TOKENIZER_NAME = "speech_tokenizer_v2.onnx"
CAMPPLUS_NAME = "campplus.onnx"
OTHER_VERSIONS = {"cosyvoice.yaml": "CosyVoice (v1)", "cosyvoice3.yaml": "Fun-CosyVoice3 (v3)"}
EXPECTED_TAGS = {
    "llm": QWEN2LM_TAG,
    "flow": "new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec",
    "hift": "new:cosyvoice.hifigan.generator.HiFTGenerator",
}
KNOWN_OTHER_TAGS = {
    "new:cosyvoice.llm.llm.TransformerLM": "CosyVoice (v1)",
    "new:cosyvoice.flow.flow.MaskedDiffWithXvec": "CosyVoice (v1)",
    "new:cosyvoice.llm.llm.CosyVoice3LM": "Fun-CosyVoice3 (v3)",
    "new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT": "Fun-CosyVoice3 (v3)",
    "new:cosyvoice.hifigan.generator.CausalHiFTGenerator": "Fun-CosyVoice3 (v3)",
}


@dataclass
class CosyVoice2Model:
    """The three networks of one model directory plus its lazily opened frontend parts.

    Built once at start-up (any thread); afterwards read-only, used from the engine thread.
    """

    model_dir: Path
    config: dict[str, Any]
    llm: Qwen2LM
    flow: CausalFlow
    hift: HiFTGenerator
    spk2info: dict[str, Any]  # raw spk2info.pt entries (speaker id -> {name: tensor}), unvalidated
    device: torch.device
    dtype: torch.dtype
    text_frontend: TextFrontend = field(init=False)
    _speech_tokenizer: SpeechTokenizer | None = field(default=None, init=False, repr=False)
    _campplus: CampPlus | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.text_frontend = TextFrontend(self.model_dir / BLANKEN_DIR)

    @property
    def sft_voices(self) -> dict[str, Any]:
        """The spk2info.pt entries (old name)."""
        return self.spk2info

    @property
    def sample_rate_hz(self) -> int:
        return int(self.config.get("sample_rate", 24000))

    @property
    def prompt_mel_fmax_hz(self) -> float | None:
        """fmax of the yaml `feat_extractor` (8000 for CosyVoice2), used for the flow prompt mel."""
        node = self.config.get("feat_extractor")
        return node.get("fmax", 8000) if isinstance(node, dict) else 8000

    @property
    def speech_tokenizer(self) -> SpeechTokenizer:
        if self._speech_tokenizer is None:
            path = required(self.model_dir / SPEECH_TOKENIZER_NAME, "CosyVoice2")
            self._speech_tokenizer = SpeechTokenizer(path)
        return self._speech_tokenizer

    @property
    def campplus(self) -> CampPlus:
        if self._campplus is None:
            self._campplus = CampPlus(required(self.model_dir / CAMPPLUS_NAME, "CosyVoice2"))
        return self._campplus


def _check_directory(model_dir: Path) -> Path:
    if not model_dir.is_dir():
        raise ModelDirError(f"{model_dir}: not a directory")
    yaml_path = model_dir / YAML_NAME
    if yaml_path.is_file():
        return yaml_path
    for name, version in OTHER_VERSIONS.items():
        if (model_dir / name).is_file():
            raise ModelDirError(
                f"{model_dir / name}: this is a {version} model directory; expected {YAML_NAME} (CosyVoice2)"
            )
    raise ModelDirError(f"{yaml_path}: not found; not a CosyVoice2 model directory")


def load_llm(
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Qwen2LM:
    """Only the speech LLM of an official-layout CosyVoice2 directory (exports, benchmarks)."""
    model_dir = Path(model_dir)
    if torch.device(device).type == "cuda":
        cuda_settings(dtype)
    yaml_path = _check_directory(model_dir)
    blanken = model_dir / BLANKEN_DIR
    config = read_config(model_dir, yaml_path)
    check_tags(config, yaml_path, EXPECTED_TAGS, KNOWN_OTHER_TAGS)
    llm_cfg = LlmConfig.from_yaml(config["llm"], required(blanken / "config.json", "CosyVoice2"))
    return build_llm(llm_cfg, load_weights(model_dir / "llm.pt"), str(model_dir / "llm.pt"), device, dtype)


def build(model_dir: Path, device: torch.device, dtype: torch.dtype) -> CosyVoice2Model:
    """The networks of an official-layout CosyVoice2 directory; LLM and flow in `dtype`, HiFT in float32.

    The frontend files are opened on first use; `load.load` smoke-runs them at start (`check_frontend`)."""
    if device.type == "cuda":
        cuda_settings(dtype)
    yaml_path = _check_directory(model_dir)
    blanken = model_dir / BLANKEN_DIR
    config = read_config(model_dir, yaml_path)
    check_tags(config, yaml_path, EXPECTED_TAGS, KNOWN_OTHER_TAGS)
    llm_cfg = LlmConfig.from_yaml(config["llm"], required(blanken / "config.json", "CosyVoice2"))
    llm = build_llm(llm_cfg, load_weights(model_dir / "llm.pt"), str(model_dir / "llm.pt"), device, dtype)

    flow = CausalFlow(FlowConfig.from_yaml(config["flow"]))
    load_flow_state_dict(flow, load_weights(model_dir / "flow.pt"), str(model_dir / "flow.pt"))
    hift = HiFTGenerator(HiftConfig.from_yaml(config["hift"]))
    load_hift_state_dict(hift, load_weights(model_dir / "hift.pt"), str(model_dir / "hift.pt"))

    model = CosyVoice2Model(
        model_dir=model_dir,
        config=config,
        llm=llm,
        flow=flow.to(device=device, dtype=dtype).eval(),
        hift=hift.to(device=device).eval(),
        spk2info=load_spk2info(model_dir / "spk2info.pt"),
        device=device,
        dtype=dtype,
    )
    logger.info("loaded CosyVoice2 from %s on %s (%s), %d spk2info entries", model_dir, device, dtype,
                len(model.spk2info))  # fmt: skip
    return model
