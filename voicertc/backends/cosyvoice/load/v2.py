"""Loads an official CosyVoice2 model directory (cosyvoice.md §1) into our modules.

Reads `cosyvoice2.yaml` for every hyperparameter (tags are checked, nothing is imported), then
`llm.pt`, `flow.pt`, `hift.pt` strictly, `CosyVoice-BlankEN/config.json` for the Qwen2 backbone and the
optional `spk2info.pt` (its entries are turned into voices by `voices.VoiceBook`, each on its own: a bad
entry disables that voice, never the engine). `check_frontend` (run by `load` unless told not to) opens
and smoke-runs every frontend file — the text tokenizer, `campplus.onnx`, `speech_tokenizer_v2.onnx` —
so a missing or broken one stops the start with a ModelDirError naming the file, instead of failing the
first speak or the first voice registration.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.flow.config import FlowConfig
from voicertc.backends.cosyvoice.flow.flow import CausalFlow, load_flow_state_dict
from voicertc.backends.cosyvoice.hift.generator import HiftConfig, HiFTGenerator
from voicertc.backends.cosyvoice.hift.weights import load_hift_state_dict
from voicertc.backends.cosyvoice.llm.qwen2lm import QWEN2LM_TAG, LlmConfig, Qwen2LM, build_llm
from voicertc.backends.cosyvoice.load.yaml_config import load_yaml, tag_of
from voicertc.backends.cosyvoice.voice.onnx_frontends import CampPlus, SpeechTokenizer
from voicertc.backends.cosyvoice.voice.text import TextFrontend
from voicertc.errors import ModelDirError

if TYPE_CHECKING:
    from voicertc.backends.cosyvoice.serve.token2wav import Token2WavStream
    from voicertc.backends.cosyvoice.voice.voices import Voice
    from voicertc.engine.schedule import ChunkSchedule

logger = logging.getLogger(__name__)

YAML_NAME = "cosyvoice2.yaml"
BLANKEN_DIR = "CosyVoice-BlankEN"
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
            self._speech_tokenizer = SpeechTokenizer(_required(self.model_dir / SPEECH_TOKENIZER_NAME))
        return self._speech_tokenizer

    @property
    def campplus(self) -> CampPlus:
        if self._campplus is None:
            self._campplus = CampPlus(_required(self.model_dir / CAMPPLUS_NAME))
        return self._campplus

    # ---- streaming API (thin delegations; see voices.py and token2wav.py) ----------------------------

    def voice_from_features(
        self, prompt_tokens: Any, prompt_feat: Tensor, embedding: Tensor, *args: Any, **kw: Any
    ) -> Voice:
        """A `Voice` from prompt speech tokens [1, p], prompt mel [1, 2p, 80] and embedding [1, 192]."""
        from voicertc.backends.cosyvoice.voice.voices import voice_from_features

        return voice_from_features(self, prompt_tokens, prompt_feat, embedding, *args, **kw)

    def voice_from_wav(self, path: str | Path, transcript: str, voice_id: str | None = None) -> Voice:
        """A zero-shot `Voice` from a 1-30 s prompt recording and its transcript."""
        from voicertc.backends.cosyvoice.voice.voices import voice_from_wav

        return voice_from_wav(self, path, transcript, voice_id)

    def token2wav_stream(
        self, voice: Voice, schedule: ChunkSchedule | None = None, **options: Any
    ) -> Token2WavStream:
        """A per-utterance `Token2WavStream` on `voice` (default `ChunkSchedule()`)."""
        from voicertc.backends.cosyvoice.serve.token2wav import open_stream
        from voicertc.engine.schedule import ChunkSchedule

        schedule = schedule or ChunkSchedule()
        if schedule.final_chunk == "reference" or options.get("speed", 1.0) != 1.0:
            prompt = (voice.flow_prompt_tokens, voice.prompt_feat, voice.embedding)
            options.setdefault("reference_prompt", prompt)
        return open_stream(self.flow, self.hift, voice.flow_state, voice.prompt_tokens, schedule, **options)


def _required(path: Path) -> Path:
    if not path.is_file():
        raise ModelDirError(f"{path}: not found (needed by the CosyVoice2 frontend)")
    return path


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


def _check_tags(config: dict[str, Any], yaml_path: Path) -> None:
    for key, expected in EXPECTED_TAGS.items():
        found = tag_of(config.get(key))
        if found == expected:
            continue
        version = KNOWN_OTHER_TAGS.get(found)
        what = f"a {version} class" if version else "something else"
        raise ModelDirError(f"{yaml_path}: `{key}` is !{found or 'missing'} ({what}); expected !{expected}")


def _load_weights(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise ModelDirError(f"{path}: not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, pickle errors, ...: torch raises several types
        raise ModelDirError(f"{path}: cannot read the checkpoint ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ModelDirError(f"{path}: expected a state dict of tensors")
    return state


def _load_spk2info(path: Path) -> dict[str, Any]:
    """Optional spk2info.pt: {speaker: {name: tensor}}; missing file = no voices. The entries are not
    validated here (VoiceBook does it per entry); an unreadable file only costs its voices."""
    if not path.is_file():
        return {}
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, pickle errors, ...: torch raises several types
        logger.error("%s: cannot read (%s: %s); its voices are disabled", path, type(exc).__name__, exc)
        return {}
    if not isinstance(raw, dict):
        logger.error("%s: expected {speaker id: {name: tensor}}, got %s; ignored", path, type(raw).__name__)
        return {}
    return {str(k): v for k, v in raw.items()}


def load_llm(
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Qwen2LM:
    """Only the speech LLM of an official-layout CosyVoice2 directory (exports, benchmarks)."""
    model_dir = Path(model_dir)
    if torch.device(device).type == "cuda":
        cuda_settings(dtype)
    yaml_path = _check_directory(model_dir)
    blanken = model_dir / BLANKEN_DIR
    config = load_yaml(yaml_path, overrides={"qwen_pretrain_path": str(blanken)})
    _check_tags(config, yaml_path)
    llm_cfg = LlmConfig.from_yaml(config["llm"], _required(blanken / "config.json"))
    return build_llm(llm_cfg, _load_weights(model_dir / "llm.pt"), str(model_dir / "llm.pt"), device, dtype)


def cuda_settings(dtype: torch.dtype) -> None:
    """Process-wide CUDA switches (torch has no per-module ones), set when a model loads on CUDA.

    - float32 means float32: cuDNN's convolutions (and matmuls) default to TF32 on Ampere and later,
      which moved the flow's mel by 1.7e-3 on an H200;
    - no cuDNN attention: on Hopper it is the preferred SDPA backend for half precision, and it builds a
      new cuDNN graph whenever the key length changes, i.e. at every eager decode step (54 ms per bf16
      step at batch 1 on the H200, against 14 ms in fp32). The flash / memory-efficient kernels serve
      the same calls; the captured decode graphs never re-plan anyway.
    """
    if dtype == torch.float32:
        if torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32:
            logger.info("float32 on CUDA: TF32 convolutions and matmuls turned off (exact float32)")
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    if torch.backends.cuda.cudnn_sdp_enabled():
        logger.info("CUDA: cuDNN attention off (it re-plans for every new key length)")
        torch.backends.cuda.enable_cudnn_sdp(False)


def load(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    check_frontend: bool = True,
) -> CosyVoice2Model:
    """Load an official-layout CosyVoice2 directory; LLM and flow in `dtype`, HiFT in float32.

    With `check_frontend` (the default) every frontend file is opened and smoke-run now
    (`frontend_checks.check_frontend`); tests of the networks alone pass False."""
    model_dir = Path(model_dir)
    device = torch.device(device)
    if device.type == "cuda":
        cuda_settings(dtype)
    yaml_path = _check_directory(model_dir)
    blanken = model_dir / BLANKEN_DIR
    config = load_yaml(yaml_path, overrides={"qwen_pretrain_path": str(blanken)})
    _check_tags(config, yaml_path)
    llm_cfg = LlmConfig.from_yaml(config["llm"], _required(blanken / "config.json"))
    llm = build_llm(llm_cfg, _load_weights(model_dir / "llm.pt"), str(model_dir / "llm.pt"), device, dtype)

    flow = CausalFlow(FlowConfig.from_yaml(config["flow"]))
    load_flow_state_dict(flow, _load_weights(model_dir / "flow.pt"), str(model_dir / "flow.pt"))
    hift = HiFTGenerator(HiftConfig.from_yaml(config["hift"]))
    load_hift_state_dict(hift, _load_weights(model_dir / "hift.pt"), str(model_dir / "hift.pt"))

    model = CosyVoice2Model(
        model_dir=model_dir,
        config=config,
        llm=llm,
        flow=flow.to(device=device, dtype=dtype).eval(),
        hift=hift.to(device=device).eval(),
        spk2info=_load_spk2info(model_dir / "spk2info.pt"),
        device=device,
        dtype=dtype,
    )
    if check_frontend:
        from voicertc.backends.cosyvoice.voice.frontend_checks import check_frontend as run_checks

        run_checks(model)
    logger.info(
        "loaded CosyVoice2 from %s on %s (%s), %d spk2info entries",
        model_dir,
        device,
        dtype,
        len(model.spk2info),
    )
    return model
