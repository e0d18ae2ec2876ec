"""spk2info.pt entries of every layout the reference writes become voices; a bad entry costs only itself."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from cv2_engine_helpers import build_speaking_model_dir
from safetensors.torch import load_file

from voicertc.backends.cosyvoice.load import load_v2 as load
from voicertc.backends.cosyvoice.serve.backend import CosyVoice2Backend
from voicertc.errors import InputError, UnknownVoiceError

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def speaking_dir(tiny_model_dir, golden_dir, tmp_path_factory) -> Path:
    return build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("cv2_spk"))


def _clone(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for entry in src.iterdir():
        if entry.name != "spk2info.pt":
            os.symlink(entry, dst / entry.name)
    return dst


def zero_shot_entry(golden_dir: Path, text_ids: list[int]) -> dict[str, torch.Tensor]:
    """What the reference's `add_zero_shot_spk` stores: every zero-shot key but `text`, no 'embedding'."""
    tts = load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")
    tokens = tts["in_prompt_token"].to(torch.int32)  # [1, 17]
    feat = tts["in_prompt_feat"]  # [1, 34, 80]
    embedding = tts["in_embedding"]  # [1, 192]
    return {
        "prompt_text": torch.tensor([text_ids], dtype=torch.int32),
        "prompt_text_len": torch.tensor([len(text_ids)], dtype=torch.int32),
        "llm_prompt_speech_token": tokens,
        "llm_prompt_speech_token_len": torch.tensor([tokens.shape[1]], dtype=torch.int32),
        "flow_prompt_speech_token": tokens,
        "flow_prompt_speech_token_len": torch.tensor([tokens.shape[1]], dtype=torch.int32),
        "prompt_speech_feat": feat,
        "prompt_speech_feat_len": torch.tensor([feat.shape[1]], dtype=torch.int32),
        "llm_embedding": embedding,
        "flow_embedding": embedding,
    }


def test_every_reference_layout_loads_and_bad_entries_are_disabled(
    speaking_dir, golden_dir, tmp_path, caplog
):
    d = _clone(speaking_dir, tmp_path / "m")
    text_ids = load(speaking_dir, check_frontend=False).text_frontend.encode("Hello world.")
    zero_shot = zero_shot_entry(golden_dir, text_ids)
    cross = {**zero_shot, "prompt_text": torch.zeros(1, 0, dtype=torch.int32)}
    no_embedding = {k: v for k, v in zero_shot.items() if not k.endswith("embedding")}
    bad_feat = {**zero_shot, "prompt_speech_feat": torch.zeros(1, 34, 7)}
    bad_token = {**zero_shot, "llm_prompt_speech_token": torch.full((1, 17), 7000, dtype=torch.int32)}
    torch.save(
        {
            "sft": {"embedding": torch.randn(1, 192)},
            "zs": zero_shot,
            "xl": cross,
            "not-a-dict": torch.zeros(3),
            "no-embedding": no_embedding,
            "bad-feat": bad_feat,
            "bad-token": bad_token,
        },
        d / "spk2info.pt",
    )
    caplog.set_level(logging.ERROR)
    backend = CosyVoice2Backend(load(d))
    assert backend.voices() == ["sft", "zs", "xl"]

    zs = backend.book.get("zs")
    assert zs.kind == "zero_shot" and zs.source == "spk2info"
    assert zs.prompt_text_tokens == tuple(text_ids)
    assert zs.llm_prompt_tokens == tuple(zero_shot["llm_prompt_speech_token"][0].tolist())
    assert zs.prompt_tokens == 17 and zs.prompt_feat.shape == (1, 34, 80)
    torch.testing.assert_close(zs.embedding, zero_shot["flow_embedding"])
    xl = backend.book.get("xl")
    assert xl.kind == "cross_lingual" and xl.prompt_text_tokens == () and xl.llm_prompt_tokens == ()
    assert xl.prompt_tokens == 17
    assert backend.book.get("sft").kind == "sft" and backend.book.get("sft").prompt_tokens == 0

    messages = "\n".join(r.getMessage() for r in caplog.records)
    for bad, why in [
        ("not-a-dict", "not a dict"),
        ("no-embedding", "flow_embedding"),
        ("bad-feat", "prompt_speech_feat"),
        ("bad-token", "7000"),
    ]:
        assert f"spk2info.pt voice {bad!r} disabled" in messages and why in messages
        with pytest.raises(UnknownVoiceError):
            backend.book.get(bad)
    with pytest.raises(InputError, match="spk2info.pt and cannot be deleted"):
        backend.delete_voice("zs")


def test_an_untrimmed_entry_is_cut_two_to_one(speaking_dir, golden_dir, tmp_path):
    d = _clone(speaking_dir, tmp_path / "m")
    entry = zero_shot_entry(golden_dir, [1, 2, 3])
    entry["flow_prompt_speech_token"] = torch.cat([entry["flow_prompt_speech_token"]] * 2, dim=1)  # 34
    torch.save({"long": entry}, d / "spk2info.pt")
    voice = CosyVoice2Backend(load(d)).book.get("long")
    assert voice.prompt_tokens == 17 and voice.prompt_feat.shape[1] == 34
