"""A tiny CosyVoice2 directory the engine can speak from: the golden tiny checkpoints plus a tiny BPE
tokenizer, tiny ONNX speech tokenizer / CAM++ (official input layout) and a one-speaker spk2info.pt."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from test_cv2_text import write_tiny_qwen_tokenizer

from voicertc.backends.cosyvoice2.engine_backend import BackendOptions, CosyVoice2Backend
from voicertc.backends.cosyvoice2.llm import SPEECH_TOKEN_SIZE
from voicertc.backends.cosyvoice2.loader import CosyVoice2Model, load
from voicertc.backends.cosyvoice2.voices import Voice

SFT_VOICE = "sft-a"
GOLDEN_VOICE = "golden"
FLOW_VOCAB = 512  # the tiny flow's speech vocabulary


class _TinySpeechTokenizer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(128, FLOW_VOCAB)

    def forward(self, feats: torch.Tensor, feats_length: torch.Tensor) -> torch.Tensor:
        # feats: [1, 128, T], feats_length: [1] -> tokens: [1, T // 4]
        pooled = torch.nn.functional.avg_pool1d(feats, 4, 4).transpose(1, 2)
        return self.proj(pooled).argmax(-1) + 0 * feats_length.to(torch.int64)


class _TinyCampPlus(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(80, 192)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        # feats: [1, T, 80] -> embedding: [1, 192]
        return self.proj(feats).mean(dim=1)


def _export(module: torch.nn.Module, args: tuple, path: Path, names: list[str], dynamic: dict) -> None:
    torch.onnx.export(
        module.eval(), args, str(path), input_names=names, output_names=["out"], dynamic_axes=dynamic,
        dynamo=False,
    )  # fmt: skip


def build_speaking_model_dir(tiny_model_dir: Path, golden_dir: Path, out: Path) -> Path:
    """Symlinks to the tiny checkpoints + the frontend files the tiny directory lacks."""
    out.mkdir(parents=True, exist_ok=True)
    for entry in tiny_model_dir.iterdir():
        if entry.name != "CosyVoice-BlankEN":
            os.symlink(entry, out / entry.name)
    blanken = out / "CosyVoice-BlankEN"
    write_tiny_qwen_tokenizer(blanken)
    for entry in (tiny_model_dir / "CosyVoice-BlankEN").iterdir():
        os.symlink(entry, blanken / entry.name)
    torch.manual_seed(0)
    example = (torch.randn(1, 128, 40), torch.tensor([40], dtype=torch.int32))
    _export(
        _TinySpeechTokenizer(), example, out / "speech_tokenizer_v2.onnx", ["feats", "feats_length"],
        {"feats": {2: "T"}, "out": {1: "T4"}},
    )  # fmt: skip
    _export(_TinyCampPlus(), (torch.randn(1, 50, 80),), out / "campplus.onnx", ["input"], {"input": {1: "T"}})
    tts = load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")
    torch.save({SFT_VOICE: {"embedding": -tts["in_embedding"][0]}}, out / "spk2info.pt")
    return out


def load_speaking_model(model_dir: Path) -> CosyVoice2Model:
    """Load it; the tiny LLM may only say the tiny flow's 512 speech ids (its real vocabulary is 6561),
    and never the stop ids 6562/6563 that the official sampler leaves unmasked below the minimum length,
    so an utterance's length is set by eos (banned below 2x the text tokens) or the test's token cap."""
    model = load(model_dir)
    with torch.no_grad():
        model.llm.llm_decoder.bias[FLOW_VOCAB:SPEECH_TOKEN_SIZE] = -1e4
        model.llm.llm_decoder.bias[SPEECH_TOKEN_SIZE + 1 :] = -1e4
    return model


def golden_voice(model: CosyVoice2Model, golden_dir: Path, voice_id: str = GOLDEN_VOICE) -> Voice:
    """The golden flow prompt (17 tokens, 34 frames) as a voice without an LLM prompt."""
    tts = load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")
    return model.voice_from_features(
        tts["in_prompt_token"], tts["in_prompt_feat"], tts["in_embedding"], voice_id=voice_id
    )


def make_backend(
    model: CosyVoice2Model, golden_dir: Path, voices_dir: Path | None = None, **options: object
) -> CosyVoice2Backend:
    defaults: dict[str, object] = {"seed": 1234, "max_segment_tokens": 80}
    backend = CosyVoice2Backend(
        model,
        voices_dir=voices_dir,
        options=BackendOptions(**{**defaults, **options}),  # type: ignore[arg-type]
    )
    backend.add_voice(golden_voice(model, golden_dir), persist=False)
    return backend
