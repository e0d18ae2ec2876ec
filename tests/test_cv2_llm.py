"""CosyVoice2 LLM against the official Qwen2LM records (golden §B4) and the full-size manifest."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from voicertc.backends.cosyvoice.llm.qwen2lm import (
    EOS_ID,
    LlmConfig,
    build_llm,
    check_state_dict,
    load_llm_state_dict,
)
from voicertc.backends.cosyvoice.llm.sampling import SamplingParams, nucleus_size
from voicertc.backends.cosyvoice.load.yaml_config import load_yaml
from voicertc.errors import ModelDirError

torch.set_num_threads(2)


def _make_weights(golden_dir):
    sys.path.insert(0, str(golden_dir))
    import make_weights

    return make_weights


@pytest.fixture(scope="module")
def tiny_cfg(golden_dir) -> LlmConfig:
    node = load_yaml(golden_dir / "model_dir" / "cosyvoice2.yaml")["llm"]
    return LlmConfig.from_yaml(node, golden_dir / "model_dir" / "CosyVoice-BlankEN" / "config.json")


@pytest.fixture(scope="module")
def tiny_sd(golden_dir) -> dict[str, torch.Tensor]:
    mw = _make_weights(golden_dir)
    manifest = json.loads((golden_dir / "tiny_llm_manifest.json").read_text())
    recipe = json.loads((golden_dir / "tiny_llm_recipe.json").read_text())
    return mw.state_dict(manifest, recipe)


@pytest.fixture(scope="module")
def llm(tiny_cfg, tiny_sd):
    return build_llm(tiny_cfg, tiny_sd, "llm.pt")


@pytest.fixture(scope="module")
def rec(golden_dir) -> dict[str, torch.Tensor]:
    return load_file(golden_dir / "llm_tiny.safetensors")


def _inputs(rec):
    return rec["in_text"][0], rec["in_prompt_text"][0], rec["in_prompt_speech_token"][0]


def test_config_from_yaml(tiny_cfg):
    assert tiny_cfg.sampling == SamplingParams(top_p=0.8, top_k=25, win_size=10, tau_r=0.1)
    assert tiny_cfg.mix_ratio == (5, 15)
    assert tiny_cfg.input_size == tiny_cfg.qwen2["hidden_size"] == 64


def test_lm_input_and_teacher_forced(llm, rec):
    text, prompt_text, prompt_speech = _inputs(rec)
    with torch.inference_mode():
        lm_input = llm.lm_input(text, prompt_text, prompt_speech)
        hidden = llm.llm(lm_input)
    torch.testing.assert_close(lm_input, rec["lm_input"], atol=1e-6, rtol=0)
    torch.testing.assert_close(hidden, rec["teacher_forced_hidden"], atol=1e-4, rtol=0)
    logits = llm.logits(text, prompt_text, prompt_speech)
    torch.testing.assert_close(logits, rec["teacher_forced_logits"], atol=1e-4, rtol=0)


def test_greedy_tokens_and_step_logits(llm, rec):
    session = llm.prefill(*_inputs(rec), sampling="greedy")
    tokens, logits = [], []
    for _ in range(20):
        tokens.append(llm.step(session))
        logits.append(session.logits)
    assert tokens == rec["greedy_tokens"].tolist()
    torch.testing.assert_close(torch.stack(logits), rec["greedy_step_logits"], atol=1e-4, rtol=0)


def test_seeded_step_logits_teacher_forced(llm, rec):
    session = llm.prefill(*_inputs(rec))
    logits = []
    for token in rec["seeded_tokens"].tolist():
        assert llm.step(session, force=token) == token
        logits.append(session.logits)
    torch.testing.assert_close(torch.stack(logits), rec["seeded_step_logits"], atol=1e-4, rtol=0)


def test_seeded_tokens_reproduce_official_rng(llm, rec):
    torch.manual_seed(777)
    tokens = []
    for token in llm.generate(*_inputs(rec)):
        tokens.append(token)
        if len(tokens) == 20:
            break
    assert tokens == rec["seeded_tokens"].tolist()


def test_seeded_generator_is_reproducible(llm, rec):
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(5)
        session = llm.prefill(*_inputs(rec), generator=gen)
        runs.append([llm.step(session) for _ in range(10)])
    assert runs[0] == runs[1]


def test_min_max_len_match_official(llm, rec):
    session = llm.prefill(*_inputs(rec))
    assert session.min_len == int(rec["inference_min_len"][0])
    assert session.max_len == int(rec["inference_max_len"][0])


def _biased(llm, tiny_cfg, tiny_sd, eos_bias: float, stop_bias: float):
    sd = dict(tiny_sd)
    bias = sd["llm_decoder.bias"].clone()
    bias[EOS_ID] = eos_bias
    bias[EOS_ID + 1 :] = stop_bias
    sd["llm_decoder.bias"] = bias
    return build_llm(tiny_cfg, sd, "llm.pt")


def test_eos_masked_until_min_len(tiny_cfg, tiny_sd, llm):
    eager_eos = _biased(llm, tiny_cfg, tiny_sd, eos_bias=1e4, stop_bias=-1e4)
    tokens = list(eager_eos.generate([1, 2, 3], [4, 5], [6, 7, 8], sampling="greedy"))
    assert len(tokens) == 6  # 2 x 3 text tokens, prompt text not counted
    assert all(t < EOS_ID for t in tokens)


def test_generation_stops_at_max_len(tiny_cfg, tiny_sd, llm):
    never_eos = _biased(llm, tiny_cfg, tiny_sd, eos_bias=-1e4, stop_bias=-1e4)
    tokens = list(
        never_eos.generate([1, 2], [4, 5, 6], sampling="ras", generator=torch.Generator().manual_seed(0))
    )
    assert len(tokens) == 40  # 20 x 2 text tokens


def test_prefix_cache_matches_full_prefill(llm, rec):
    text, prompt_text, prompt_speech = _inputs(rec)
    prefix = llm.prefix_cache(prompt_text)
    full = llm.prefill(text, prompt_text, prompt_speech, sampling="greedy")
    for _ in range(2):  # the prefix stays reusable
        cached = llm.prefill(text, prompt_text, prompt_speech, sampling="greedy", prefix=prefix)
        for expected in rec["greedy_tokens"].tolist()[:8]:
            assert llm.step(cached) == expected
        torch.testing.assert_close(cached.logits, rec["greedy_step_logits"][7], atol=1e-4, rtol=0)
    assert llm.step(full) == rec["greedy_tokens"][0]
    with pytest.raises(ValueError, match="prompt text"):
        llm.prefill(text, prompt_text[:-1], prompt_speech, prefix=prefix)


@pytest.mark.parametrize(
    ("text", "prompt_text", "prompt_speech", "what"),
    [
        ([1, 1000], [], [], "text token id 1000"),
        ([-1], [], [], "text token id -1"),
        ([1], [5000], [], "text token id 5000"),
        ([1], [], [6561], "speech token id 6561"),
        ([1], [], [-3], "speech token id -3"),
    ],
)
def test_out_of_vocabulary_ids_raise(llm, text, prompt_text, prompt_speech, what):
    with pytest.raises(ValueError, match=what):
        llm.prefill(text, prompt_text, prompt_speech)
    with pytest.raises(ValueError, match=what):
        llm.logits(text, prompt_text, prompt_speech)


def test_strict_load_errors_name_file_and_key(llm, tiny_sd):
    missing = {k: v for k, v in tiny_sd.items() if k != "llm_decoder.bias"}
    with pytest.raises(ModelDirError, match=r"llm\.pt.*missing.*llm_decoder\.bias"):
        load_llm_state_dict(llm, missing, "llm.pt")
    extra = {**tiny_sd, "llm.model.model.layers.9.mlp.up_proj.weight": torch.zeros(1)}
    with pytest.raises(ModelDirError, match=r"my/llm\.pt.*unexpected.*layers\.9"):
        load_llm_state_dict(llm, extra, "my/llm.pt")
    wrong = {**tiny_sd, "speech_embedding.weight": torch.zeros(6563, 64)}
    with pytest.raises(ModelDirError, match=r"speech_embedding\.weight: file \[6563, 64\]"):
        load_llm_state_dict(llm, wrong, "llm.pt")


def test_nucleus_includes_crossing_token():
    probs = torch.tensor([0.5, 0.25, 0.2, 0.05])
    assert nucleus_size(probs, top_p=0.8, top_k=25) == 3  # 0.5, 0.75 < 0.8, then 0.95 crosses
    assert nucleus_size(probs, top_p=0.8, top_k=2) == 2
    assert nucleus_size(probs, top_p=0.4, top_k=25) == 1


@pytest.mark.slow
def test_full_size_manifest_loads_strictly(golden_dir, tmp_path):
    """The real CosyVoice2-0.5B llm.pt layout (640 M parameters, tied lm_head) loads strictly."""
    info = json.loads((golden_dir / "cv2_manifest_info.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(info["qwen2_config"]))
    node = {"llm_input_size": 896, "llm_output_size": 896, "speech_token_size": 6561}
    cfg = LlmConfig.from_yaml(node, tmp_path / "config.json")
    manifest = json.loads((golden_dir / "cv2_llm_manifest.json").read_text())
    meta_sd = {m["name"]: torch.empty(m["shape"], device="meta") for m in manifest}
    with torch.device("meta"):
        from voicertc.backends.cosyvoice.llm.qwen2lm import Qwen2LM

        check_state_dict(Qwen2LM(cfg), meta_sd, "llm.pt")
    recipe = {"base_seed": 1, "tied": {"llm.model.lm_head.weight": "llm.model.model.embed_tokens.weight"}}
    sd = _make_weights(golden_dir).state_dict(manifest, recipe)
    model = build_llm(cfg, sd, "llm.pt")
    assert model.llm.model.lm_head.weight is model.llm.model.model.embed_tokens.weight
    torch.testing.assert_close(model.speech_embedding.weight, sd["speech_embedding.weight"], atol=0, rtol=0)
    session = model.prefill([1, 2, 3], [], [], sampling="greedy")
    assert 0 <= model.step(session) < 6561
