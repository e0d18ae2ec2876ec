"""CosyVoice2 flow: config from the yaml, checkpoint layout, whole-prefix parity with the golden records."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
from torch.testing import assert_close

from voicertc.backends.cosyvoice.flow.config import FlowConfig
from voicertc.backends.cosyvoice.flow.flow import CausalFlow, load_flow_state_dict
from voicertc.backends.cosyvoice.load.yaml_config import load_yaml
from voicertc.errors import InputError, ModelDirError

ATOL = 1e-4
RTOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def make_weights(golden_dir):
    sys.path.insert(0, str(golden_dir))
    import make_weights as module

    return module


def _inputs(g: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return g["in_token"], g["in_prompt_token"], g["in_prompt_feat"], g["in_embedding"]


class _Recorder:
    """Forward hooks that keep what the encoder, estimator and CFM saw (no behaviour change)."""

    def __init__(self, flow: CausalFlow) -> None:
        self.calls: dict[str, list] = {"encoder": [], "estimator": [], "cfm": []}
        self.handles = [
            flow.encoder.register_forward_hook(self._hook("encoder")),
            flow.decoder.estimator.register_forward_hook(self._hook("estimator")),
            flow.decoder.register_forward_hook(self._hook("cfm")),
        ]

    def _hook(self, name: str):
        def record(module, args, output):
            self.calls[name].append((args, output))

        return record

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@pytest.fixture(scope="module")
def nonstream(flow, golden):
    recorder = _Recorder(flow)
    try:
        mel = flow.infer(*_inputs(golden), streaming=False, finalize=True)
    finally:
        recorder.remove()
    return mel, recorder.calls


def test_config_from_tiny_yaml(tiny_model_dir, golden_dir):
    cfg = FlowConfig.from_yaml(load_yaml(tiny_model_dir / "cosyvoice2.yaml")["flow"])
    tiny = json.loads((golden_dir / "tiny_flow_config.json").read_text())
    est = tiny["decoder"]["estimator"]
    assert cfg.vocab_size == tiny["vocab_size"]
    assert cfg.encoder.linear_units == tiny["encoder"]["linear_units"]
    assert cfg.encoder.num_blocks == tiny["encoder"]["num_blocks"]
    assert cfg.chunk_tokens == tiny["encoder"]["static_chunk_size"]
    assert (cfg.estimator.channels, cfg.estimator.attention_head_dim) == (
        est["channels"][0],
        est["attention_head_dim"],
    )
    assert (cfg.estimator.n_blocks, cfg.estimator.num_mid_blocks) == (est["n_blocks"], est["num_mid_blocks"])
    assert cfg.estimator.num_heads == est["num_heads"]
    assert cfg.estimator.time_embed_dim == est["time_embed_dim"]
    assert cfg.inference_cfg_rate == tiny["decoder"]["cfm_params"]["inference_cfg_rate"]


def test_config_rejects_other_flow_class(tiny_model_dir):
    node = load_yaml(tiny_model_dir / "cosyvoice2.yaml")["flow"]
    node = {**node, "__tag__": "new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT"}
    with pytest.raises(ModelDirError, match="cosyvoice2.yaml"):
        FlowConfig.from_yaml(node)


def test_config_from_official_values_is_full_size(tiny_model_dir):
    node = copy.deepcopy(load_yaml(tiny_model_dir / "cosyvoice2.yaml")["flow"])
    node["vocab_size"] = 6561
    node["encoder"].update(linear_units=2048, num_blocks=6)
    node["decoder"]["estimator"].update(
        channels=[256], attention_head_dim=64, n_blocks=4, num_mid_blocks=12, num_heads=8
    )
    assert FlowConfig.from_yaml(node) == FlowConfig.full_size()


def test_tiny_state_dict_layout_matches_manifest(golden_dir):
    manifest = json.loads((golden_dir / "tiny_flow_manifest.json").read_text())
    flow = CausalFlow(FlowConfig.from_yaml(load_yaml(golden_dir / "model_dir" / "cosyvoice2.yaml")["flow"]))
    got = [(k, list(v.shape)) for k, v in flow.state_dict().items()]
    assert got == [(e["name"], e["shape"]) for e in manifest]


def test_full_size_manifest_loads_strictly(golden_dir, make_weights):
    manifest = json.loads((golden_dir / "cv2_flow_manifest.json").read_text())
    weights = make_weights.state_dict(manifest, {"base_seed": 2})
    flow = CausalFlow(FlowConfig.full_size())
    load_flow_state_dict(flow, weights, "flow.pt")
    assert sum(p.numel() for p in flow.parameters()) == sum(w.numel() for w in weights.values())
    key = "decoder.estimator.mid_blocks.11.1.3.attn1.to_k.weight"
    assert torch.equal(flow.state_dict()[key], weights[key])

    missing = dict(weights)
    del missing["encoder.encoders.5.self_attn.pos_bias_u"]
    with pytest.raises(
        ModelDirError, match=r"flow\.pt.*missing.*encoder\.encoders\.5\.self_attn\.pos_bias_u"
    ):
        load_flow_state_dict(flow, missing, "flow.pt")
    wrong = dict(weights)
    wrong["encoder_proj.weight"] = torch.zeros(80, 256)
    with pytest.raises(ModelDirError, match=r"flow\.pt.*encoder_proj\.weight.*\[80, 256\]"):
        load_flow_state_dict(flow, wrong, "flow.pt")
    extra = {**weights, "decoder.estimator.rotary_embed.inv_freq": torch.zeros(32)}
    with pytest.raises(ModelDirError, match=r"unexpected.*rotary_embed\.inv_freq"):
        load_flow_state_dict(flow, extra, "flow.pt")


def test_nonstream_mel(nonstream, golden, tts_golden):
    mel, _ = nonstream
    assert_close(mel, golden["nonstream_mel"], atol=ATOL, rtol=RTOL)
    # the official streaming loop runs its final chunk with full attention over everything
    assert_close(mel, tts_golden["stream_call3_flow_mel_full"], atol=ATOL, rtol=RTOL)
    assert_close(mel[:, :, -34:], tts_golden["stream_call3_flow_mel_after_offset_cut"], atol=ATOL, rtol=RTOL)


def test_nonstream_intermediates(nonstream, golden, flow):
    _, calls = nonstream
    ((_, encoder_out),) = calls["encoder"]
    assert_close(encoder_out, golden["nonstream_encoder_out"], atol=ATOL, rtol=RTOL)
    with torch.inference_mode():
        assert_close(flow.encoder_proj(encoder_out), golden["nonstream_mu"], atol=ATOL, rtol=RTOL)
    ((cfm_args, cfm_out),) = calls["cfm"]
    noise, mu, spks, cond = cfm_args[:4]
    assert_close(noise, golden["nonstream_noise_z"], atol=0.0, rtol=0.0)
    assert_close(mu, golden["nonstream_mu"].transpose(1, 2), atol=ATOL, rtol=RTOL)
    assert_close(spks, golden["nonstream_spks"], atol=ATOL, rtol=RTOL)
    assert_close(cond, golden["nonstream_cond"], atol=0.0, rtol=0.0)
    assert_close(cfm_out, golden["nonstream_decoder_out_with_prompt"], atol=ATOL, rtol=RTOL)
    steps = calls["estimator"]
    assert len(steps) == 10
    t_fed = torch.stack([args[2][0] for args, _ in steps])
    assert_close(t_fed, golden["nonstream_est_t_all_steps"], atol=0.0, rtol=0.0)
    step0_args, step0_out = steps[0]
    assert_close(step0_args[1], golden["nonstream_est_step0_mu_in"], atol=ATOL, rtol=RTOL)
    assert_close(step0_args[3], golden["nonstream_est_step0_spks_in"], atol=ATOL, rtol=RTOL)
    assert_close(step0_args[4], golden["nonstream_est_step0_cond_in"], atol=0.0, rtol=0.0)
    assert_close(step0_out, golden["nonstream_est_step0_out"], atol=ATOL, rtol=RTOL)


def test_chunk_mask_whole_utterance(flow, golden):
    recorder = _Recorder(flow)
    try:
        mel = flow.infer(*_inputs(golden), streaming=True, finalize=True)
    finally:
        recorder.remove()
    ((_, encoder_out),) = recorder.calls["encoder"]
    assert_close(encoder_out, golden["chunkmask_encoder_out"], atol=ATOL, rtol=RTOL)
    with torch.inference_mode():
        assert_close(flow.encoder_proj(encoder_out), golden["chunkmask_mu"], atol=ATOL, rtol=RTOL)
    assert_close(mel, golden["chunkmask_mel"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("call, tokens_passed", [(0, 36), (1, 86), (2, 186)])
def test_official_streaming_recompute_chunks(flow, tts_golden, call, tokens_passed):
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(tts_golden)
    mel = flow.infer(
        tokens[:, :tokens_passed], prompt_tokens, prompt_feat, embedding, streaming=True, finalize=False
    )
    assert mel.shape == (1, 80, 2 * (tokens_passed - 3))
    assert_close(mel, tts_golden[f"stream_call{call}_flow_mel_full"], atol=ATOL, rtol=RTOL)


def test_bad_token_ids_raise(flow, golden):
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(golden)
    for bad in (-1, flow.cfg.vocab_size):
        wrong = tokens.clone()
        wrong[0, 7] = bad
        with pytest.raises(ValueError, match=str(bad)):
            flow.infer(wrong, prompt_tokens, prompt_feat, embedding, streaming=False, finalize=True)


def test_too_long_raises_before_computing(flow, golden):
    _, prompt_tokens, prompt_feat, embedding = _inputs(golden)
    tokens = torch.zeros(1, 7500, dtype=torch.long)
    with pytest.raises(InputError, match="15000"):
        flow.infer(tokens, prompt_tokens, prompt_feat, embedding, streaming=False, finalize=True)


def test_prompt_feat_must_match_prompt_tokens(flow, golden):
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(golden)
    with pytest.raises(ValueError, match="34"):
        flow.infer(tokens, prompt_tokens[:, :-1], prompt_feat, embedding, streaming=False, finalize=True)
