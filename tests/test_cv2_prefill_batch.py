"""Prompts of several utterances prefilled together (what `decode_batch` does with decode graphs on: one
padded prompt step, `DecodeGraphs.prompt_logits`, or where none fits one ragged forward,
`SlotKV.forward_ragged`): every session gets the logits it gets fed alone, its row grows by its own
prompt length, and the steps after it (batched decode through the static step) give the tokens each
session decodes alone. Runs on CPU with the static steps uncaptured."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from voicertc.backends.cosyvoice.accel.tape import TapeCapture
from voicertc.backends.cosyvoice.llm.batch import decode_batch
from voicertc.backends.cosyvoice.llm.graphs import DecodeGraphs
from voicertc.backends.cosyvoice.llm.kv import SlotKV
from voicertc.backends.cosyvoice.load.v2 import load_llm

TEXTS = [[5, 9, 2], [7, 1, 3, 8, 4, 6, 2, 9], [3, 3]]  # prompts of different lengths


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return load_llm(tiny_model_dir)


def _sessions(llm, pool: SlotKV):
    return [llm.prefill(text, sampling="greedy", kv=pool.acquire()) for text in TEXTS]


def test_ragged_prefill_equals_each_prompt_fed_alone(llm):
    backbone = llm.llm.model.model
    alone_pool, ragged_pool = SlotKV(backbone, slots=4, capacity=64), SlotKV(backbone, slots=8, capacity=64)
    graphs = DecodeGraphs(ragged_pool, llm.llm_decoder, max_rows=4, capture=TapeCapture())
    alone, together = _sessions(llm, alone_pool), _sessions(llm, ragged_pool)
    alone_tokens, prompt_lengths = [], []
    for s in alone:  # each alone, no graphs
        tokens = [decode_batch(llm, [s])[0]]
        prompt_lengths.append(s.cache.length)
        alone_tokens.append(tokens + [decode_batch(llm, [s])[0] for _ in range(5)])
    first = decode_batch(llm, together, graphs)  # the three prompts: one prompt step
    assert len(graphs._prompts) == 1 and graphs.prompt_eager == 0 and graphs.prompt_replays == 1
    assert [t.cache.length for t in together] == prompt_lengths  # each row grew by its own prompt
    assert len(set(prompt_lengths)) == len(TEXTS)
    rest = [decode_batch(llm, together, graphs) for _ in range(5)]  # batched static steps
    together_tokens = [[first[i], *(step[i] for step in rest)] for i in range(len(TEXTS))]
    assert together_tokens == alone_tokens
    assert all(isinstance(t, int) for row in together_tokens for t in row)


def test_the_ragged_forward_gives_each_rows_last_hidden_state(llm):
    backbone = llm.llm.model.model
    hidden_size = backbone.config.hidden_size
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randn(1, n, hidden_size, generator=gen) for n in (2, 9, 5)]
    alone_pool, ragged_pool = SlotKV(backbone, slots=4, capacity=32), SlotKV(backbone, slots=4, capacity=32)
    expected = []
    for p in prompts:
        slot = alone_pool.acquire()
        expected.append(slot.feed(p)[0, -1])
    rows = [ragged_pool.acquire() for _ in prompts]
    got = ragged_pool.forward_ragged(rows, prompts)
    assert_close(got, torch.stack(expected), atol=1e-5, rtol=1e-5)
    assert [r.length for r in rows] == [2, 9, 5]
