"""The estimators' q/k/v stacked into one matmul (`flow.qkv.fuse_qkv`, on the captured path): a streamed
utterance of CosyVoice2's UNet and of CosyVoice3's DiT equals the three-projection one, and the state
dict (keys, loading) is untouched."""

from __future__ import annotations

import torch
from flow_stream_helpers import stream_golden

from voicertc.backends.cosyvoice.flow.qkv import fuse_qkv

TOL = 1e-5


def _unfuse(estimator) -> None:
    for module in estimator.modules():
        if "qkv_weight" in module._buffers:
            module._buffers["qkv_weight"] = module._buffers["qkv_bias"] = None


def test_the_unet_with_stacked_qkv_streams_the_same_mel(flow, tts_golden):
    estimator = flow.decoder.estimator
    keys = set(estimator.state_dict())
    expected = stream_golden(flow, tts_golden, [25, 50])
    try:
        assert fuse_qkv(estimator) == sum(1 for m in estimator.modules() if type(m).__name__ == "Attention")
        assert set(estimator.state_dict()) == keys  # non-persistent: checkpoints load as before
        got = stream_golden(flow, tts_golden, [25, 50])
    finally:
        _unfuse(estimator)
    assert got.shape == expected.shape and (got - expected).abs().max().item() <= TOL


def test_the_dit_with_stacked_qkv_and_biases_streams_the_same_mel(cv3_model, cv3_records):
    flow, g = cv3_model.flow, cv3_records("flow_nonstream.safetensors")

    def stream() -> torch.Tensor:
        state = flow.init_stream(g["in_prompt_token"].long(), g["in_prompt_feat"], g["in_embedding"])
        tokens = g["in_token"].long()
        first = flow.stream_step(tokens[:, : 29 + 3], state, finalize=False)
        return torch.cat([first, flow.stream_step(tokens[:, 29:], state, finalize=True)], dim=2)

    expected = stream()
    try:
        assert fuse_qkv(flow.decoder.estimator) > 0
        attn = next(m for m in flow.decoder.estimator.modules() if "qkv_weight" in m._buffers)
        assert attn.qkv_bias is not None  # the DiT's projections carry biases
        got = stream()
    finally:
        _unfuse(flow.decoder.estimator)
    assert (got - expected).abs().max().item() <= TOL
