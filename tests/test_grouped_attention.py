"""`llm.kv.grouped_attention` (the slot cache's attention, one read of each kv head) equals attention over
keys/values repeated per query head (`repeat_interleave`, what transformers' Qwen2 does), for decode
steps and prompts, ragged masks, 1..n query heads per kv head; the mask `SlotKV` makes once per
forward (`attention_mask`: additive, grouped) gives the bool mask's attention bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from voicertc.backends.cosyvoice.llm.kv import attention_mask, grouped_attention


@pytest.mark.parametrize(("batch", "heads", "kv_heads", "n_new", "span"), [
    (1, 14, 2, 1, 37), (5, 14, 2, 1, 64), (3, 8, 8, 4, 20), (2, 6, 3, 9, 9), (4, 4, 1, 3, 50),
])  # fmt: skip
def test_grouped_equals_repeated_keys(batch, heads, kv_heads, n_new, span):
    gen = torch.Generator().manual_seed(batch * 100 + heads + span)
    dim = 16
    q = torch.randn(batch, heads, n_new, dim, generator=gen, dtype=torch.float64)
    keys = torch.randn(batch, kv_heads, span, dim, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, kv_heads, span, dim, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, span - n_new + 1, (batch,), generator=gen)  # ragged rows, like the slots
    positions = lengths[:, None] + torch.arange(n_new)[None, :]
    mask = torch.arange(span)[None, None, None, :] <= positions[:, None, :, None]
    groups = heads // kv_heads
    want = F.scaled_dot_product_attention(
        q,
        keys.repeat_interleave(groups, dim=1),
        values.repeat_interleave(groups, dim=1),
        attn_mask=mask,
        scale=0.125,
    )
    got = grouped_attention(q, keys, values, mask, 0.125)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-12
    # the mask made once per forward (additive, in the grouped layout) = the bool mask, bit for bit
    once = attention_mask(mask, groups, torch.float64)
    assert once.shape == (batch, 1, groups * n_new, span) and once.dtype == torch.float64
    assert torch.equal(grouped_attention(q, keys, values, once, 0.125), got)


def test_a_row_sees_only_its_own_keys():
    """Changing keys past a row's mask, or another row's keys, changes nothing of that row."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 1, 8, generator=gen)
    keys, values = torch.randn(2, 2, 10, 8, generator=gen), torch.randn(2, 2, 10, 8, generator=gen)
    mask = torch.arange(10)[None, None, None, :] <= torch.tensor([3, 9])[:, None, None, None]
    before = grouped_attention(q, keys, values, mask, 0.3)
    keys2, values2 = keys.clone(), values.clone()
    keys2[0, :, 4:] += 5.0
    values2[0, :, 4:] -= 5.0
    values2[1] += 1.0  # row 1 changes: row 0 must not
    after = grouped_attention(q, keys2, values2, mask, 0.3)
    assert torch.equal(after[0], before[0])
    assert not torch.allclose(after[1], before[1])
