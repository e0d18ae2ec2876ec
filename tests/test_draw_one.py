"""`sampling.draw_one` is `torch.multinomial(weights, 1)` without the validity checks that cost two host
syncs per row on CUDA: the same ids and the same generator state afterwards, for nucleus-shaped
weights (zeros past the nucleus) and for whole distributions."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from voicertc.backends.cosyvoice.llm.sampling import draw_one


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    size=st.integers(1, 300),
    kept=st.integers(1, 30),
    sharp=st.floats(0.1, 8.0),
)
def test_draw_one_is_multinomial_without_the_checks(seed, size, kept, sharp):
    make = torch.Generator().manual_seed(seed ^ 0x5EED)
    weights = (torch.randn(size, generator=make) * sharp).softmax(dim=0)
    weights[min(kept, size) :] = 0.0  # a nucleus: the rest of the sorted vocabulary weighs nothing
    ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    for _ in range(3):
        expected = torch.multinomial(weights, 1, replacement=True, generator=theirs)
        got = draw_one(weights, ours)
        assert torch.equal(got, expected)
        assert weights[got].item() > 0
    assert torch.equal(ours.get_state(), theirs.get_state())
