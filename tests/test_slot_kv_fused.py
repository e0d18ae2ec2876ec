"""`SlotKV(fused=True)` (the CUDA default: q/k/v and gate/up as one matmul each, one-op RMSNorm, q and k
rotated together) computes what the transformers-module layers compute (`fused=False`, the CPU default):
ragged prompts, batched decode steps, the cache contents, and the static decode step of the CUDA-graph
path, on the tiny golden LLM in float32."""

from __future__ import annotations

import torch
from torch.testing import assert_close
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from voicertc.backends.cosyvoice.llm.graphs import DecodeGraphs
from voicertc.backends.cosyvoice.llm.kv import SlotKV, rotate
from voicertc.backends.cosyvoice.load.v2 import load_llm

TOL = {"atol": 2e-5, "rtol": 2e-5}


def _pools(tiny_model_dir):
    llm = load_llm(tiny_model_dir)
    backbone = llm.llm.model.model
    return (
        llm,
        SlotKV(backbone, slots=4, capacity=32, fused=False),
        SlotKV(backbone, slots=4, capacity=32, fused=True),
    )


def test_default_is_unfused_on_cpu(tiny_model_dir):
    llm = load_llm(tiny_model_dir)
    assert SlotKV(llm.llm.model.model, slots=1, capacity=8).fused is None


def test_fused_layers_equal_the_module_layers(tiny_model_dir):
    llm, plain, fused = _pools(tiny_model_dir)
    hidden = llm.llm.model.model.config.hidden_size
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randn(1, n, hidden, generator=gen) for n in (5, 11, 8)]
    rows_plain = [plain.acquire() for _ in prompts]
    rows_fused = [fused.acquire() for _ in prompts]
    assert_close(fused.forward_ragged(rows_fused, prompts), plain.forward_ragged(rows_plain, prompts), **TOL)
    for _ in range(6):  # a capacity growth (32 -> 64) on the way
        embeds = torch.randn(3, 1, hidden, generator=gen) * 3
        assert_close(fused.forward(rows_fused, embeds), plain.forward(rows_plain, embeds), **TOL)
    for a, b in zip(rows_plain, rows_fused, strict=True):
        assert a.length == b.length
        assert_close(fused.k[:, b.index, :, : b.length], plain.k[:, a.index, :, : a.length], **TOL)
        assert_close(fused.v[:, b.index, :, : b.length], plain.v[:, a.index, :, : a.length], **TOL)


def test_the_static_decode_step_on_fused_layers(tiny_model_dir):
    llm, plain, fused = _pools(tiny_model_dir)
    head, hidden = llm.llm_decoder, llm.llm.model.model.config.hidden_size
    graphs = DecodeGraphs(fused, head, max_rows=4)
    gen = torch.Generator().manual_seed(5)
    rows_plain, rows_fused = [], []
    for n in (3, 9):
        prompt = torch.randn(1, n, hidden, generator=gen)
        rows_plain.append(plain.acquire())
        rows_fused.append(fused.acquire())
        rows_plain[-1].feed(prompt)
        rows_fused[-1].feed(prompt)
    for _ in range(3):
        embeds = torch.randn(2, 1, hidden, generator=gen)
        assert_close(graphs.logits(rows_fused, embeds), head(plain.forward(rows_plain, embeds)[:, -1]), **TOL)


def test_rotate_is_transformers_rotary():
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 5, 4, 8, generator=gen)  # [B, T, heads, D]
    k = torch.randn(2, 5, 2, 8, generator=gen)
    angles = torch.randn(2, 5, 8, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    assert torch.equal(rotate(q, cos, sin), want_q.transpose(1, 2))
    assert torch.equal(rotate(k, cos, sin), want_k.transpose(1, 2))
