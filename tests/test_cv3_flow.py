"""CosyVoice3 flow (DiT): whole-utterance parity with intermediates, the chunk-mask variant, and the
incremental flow (K/V caches) equal to the chunk-masked whole-utterance mel."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from voicertc.backends.cosyvoice.flow.cfm import cosine_t_span, fixed_noise
from voicertc.backends.cosyvoice.flow.unet import EstimatorCache

TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def g(cv3_records):
    return cv3_records("flow_nonstream.safetensors")


@pytest.fixture(scope="module")
def flow(cv3_model):
    return cv3_model.flow


def _infer(flow, g, streaming: bool) -> torch.Tensor:
    return flow.infer(
        g["in_token"], g["in_prompt_token"], g["in_prompt_feat"], g["in_embedding"],
        streaming=streaming, finalize=True,
    )  # fmt: skip


def test_whole_utterance_mel_matches_reference(flow, g):
    mel = _infer(flow, g, streaming=False)
    assert mel.shape == (1, 80, 240)
    assert_close(mel, g["nonstream_mel"], **TOL)


def test_chunk_mask_mel_matches_reference(flow, g):
    assert_close(_infer(flow, g, streaming=True), g["chunkmask_mel"], **TOL)


def test_speaker_projection_lookahead_mu_and_noise(flow, g):
    with torch.inference_mode():
        spks = flow.spk_embed_affine_layer(torch.nn.functional.normalize(g["in_embedding"], dim=1))
        tokens = torch.cat([g["in_prompt_token"], g["in_token"]], dim=1).long()
        from voicertc.backends.cosyvoice.flow.encoder import EncoderCache

        h = flow.lookahead(tokens, None, EncoderCache())
    assert_close(spks, g["nonstream_spks"], **TOL)
    assert_close(h, g["nonstream_pre_lookahead_out"], **TOL)
    assert_close(h.repeat_interleave(2, dim=1).transpose(1, 2), g["nonstream_mu"], **TOL)
    assert torch.equal(fixed_noise()[:, :, :282], g["nonstream_noise_z"])
    assert torch.equal(cosine_t_span(10)[:10], g["nonstream_est_t_all_steps"])


@pytest.mark.parametrize("step", [0, 9])
def test_dit_estimator_matches_reference_steps(flow, g, step):
    """Step 0 from the recorded batch-2 CFG inputs; step 9's output through the whole solver (hook)."""
    estimator = flow.decoder.estimator
    if step == 0:
        t = g["nonstream_est_t_all_steps"][0].expand(2)
        with torch.inference_mode():
            out = estimator(
                g["nonstream_est_step0_x_in"], g["nonstream_est_step0_mu_in"], t,
                g["nonstream_est_step0_spks_in"], g["nonstream_est_step0_cond_in"], [EstimatorCache()], False,
            )  # fmt: skip
        assert_close(out, g["nonstream_est_step0_out"], **TOL)
        return
    outputs = []
    handle = estimator.register_forward_hook(lambda module, args, out: outputs.append(out))
    try:
        _infer(flow, g, streaming=False)
    finally:
        handle.remove()
    assert len(outputs) == 10
    assert_close(outputs[9], g["nonstream_est_step9_out"], **TOL)


def test_chunk_mask_estimator_step0(flow, g):
    outputs = []
    handle = flow.decoder.estimator.register_forward_hook(lambda module, args, out: outputs.append(out))
    try:
        _infer(flow, g, streaming=True)
    finally:
        handle.remove()
    assert_close(outputs[0], g["chunkmask_est_step0_out"], **TOL)


@pytest.mark.parametrize("hops", [(29, 50, 41), (4, 25, 25, 25, 25, 16), (54, 66)])
def test_incremental_flow_equals_chunk_masked_whole(flow, g, hops):
    """Chunks ending on the 25-token grid (counted from the 21-token prompt) with the 3 lookahead
    tokens, caches carried: the concatenated mel is the chunk-masked whole-utterance mel."""
    state = flow.init_stream(g["in_prompt_token"].long(), g["in_prompt_feat"], g["in_embedding"])
    tokens, start, mels = g["in_token"].long(), 0, []
    for i, hop in enumerate(hops):
        final = i == len(hops) - 1
        end = start + hop
        new = tokens[:, start : end if final else end + 3]
        mels.append(flow.stream_step(new, state, finalize=final))
        start = end
    assert [m.shape[2] for m in mels] == [2 * h for h in hops]
    assert_close(torch.cat(mels, dim=2), g["chunkmask_mel"], **TOL)
