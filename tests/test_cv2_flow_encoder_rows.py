"""Utterances that start together encode together: `UpsampleConformerEncoder.forward_rows` (one batched
encoder forward for B utterances whose caches line up) computes what each utterance's own `forward`
does, and `CausalFlow.stream_step_batch` uses it (so a batch of first chunks costs one encoder's
launches on a GPU, not B of them) - with and without a voice's forked prompt prefix."""

from __future__ import annotations

import pytest
import torch
from flow_stream_helpers import GRID, LOOKAHEAD, golden_flow_voice

from voicertc.backends.cosyvoice.flow.encoder import rows_line_up, stacked_prefix
from voicertc.backends.cosyvoice.flow.flow import CausalFlow

ROWS = 3


@pytest.fixture(scope="module")
def flow(tiny_model_dir) -> CausalFlow:
    return CausalFlow.from_model_dir(tiny_model_dir)


def _count_rows_calls(monkeypatch, flow: CausalFlow) -> list[int]:
    calls: list[int] = []
    original = flow.encoder.forward_rows

    def counted(token_emb, *args, **kwargs):
        calls.append(token_emb.shape[0])
        return original(token_emb, *args, **kwargs)

    monkeypatch.setattr(flow.encoder, "forward_rows", counted)
    return calls


def _speech(tts_golden, row: int) -> torch.Tensor:
    tokens = tts_golden["in_token"]
    return torch.roll(tokens, shifts=7 * row, dims=1)  # different tokens per utterance, same length


@pytest.mark.parametrize("forked", [False, True], ids=["fresh", "voice-prefix"])
def test_batched_first_and_later_chunks_equal_each_alone(monkeypatch, flow, tts_golden, forked):
    voice = golden_flow_voice(flow, tts_golden)
    pad = -tts_golden["in_prompt_token"].shape[1] % GRID
    hops = [pad + 25, 50]
    if forked:  # a history encoded once, each utterance a fork of it (`FlowStreamState.clone`: a prefix)
        flow.stream_step(tts_golden["in_token"][:, : pad + 25 + LOOKAHEAD], voice, finalize=False)
        hops = [25, 50]
    speech = [_speech(tts_golden, r) for r in range(ROWS)]

    def run(batched: bool) -> list[torch.Tensor]:
        states = [voice.clone() for _ in range(ROWS)]
        outs: list[list[torch.Tensor]] = [[] for _ in range(ROWS)]
        offset = 0
        for hop in hops:
            pieces = [s[:, offset : offset + hop + LOOKAHEAD] for s in speech]
            if batched:
                mels = flow.stream_step_batch(pieces, states, finalize=False)
            else:
                mels = [flow.stream_step(p, st, finalize=False) for p, st in zip(pieces, states, strict=True)]
            for r in range(ROWS):
                outs[r].append(mels[r])
            offset += hop
        tails = [s[:, offset : offset + 12] for s in speech]
        finals = flow.stream_step_batch(tails, states, True) if batched else [
            flow.stream_step(t, st, True) for t, st in zip(tails, states, strict=True)
        ]  # fmt: skip
        return [torch.cat([*outs[r], finals[r]], dim=2) for r in range(ROWS)]

    alone = run(False)
    calls = _count_rows_calls(monkeypatch, flow)
    together = run(True)
    assert calls == [ROWS] * (len(hops) + 1)  # every chunk encoded as one batch
    for r in range(ROWS):
        assert together[r].shape == alone[r].shape
        assert (together[r] - alone[r]).abs().max().item() <= 1e-5
    assert (alone[0] - alone[1]).abs().max().item() > 1e-3  # the rows really differ


def test_utterances_at_different_positions_encode_one_by_one(monkeypatch, flow, tts_golden):
    voice = golden_flow_voice(flow, tts_golden)
    a, b = voice.clone(), voice.clone()
    pad = -tts_golden["in_prompt_token"].shape[1] % GRID
    tokens = tts_golden["in_token"]
    flow.stream_step(tokens[:, : pad + 25 + LOOKAHEAD], a, finalize=False)  # A is a chunk ahead
    assert not rows_line_up([a.encoder, b.encoder])
    calls = _count_rows_calls(monkeypatch, flow)
    same = b.pending_prompt.shape[1] + pad + 25  # both advance by this many tokens
    want_a = flow.stream_step(tokens[:, pad + 25 : pad + 25 + same + LOOKAHEAD], a.clone(), finalize=False)
    mels = flow.stream_step_batch(
        [tokens[:, pad + 25 : pad + 25 + same + LOOKAHEAD], tokens[:, : pad + 25 + LOOKAHEAD]], [a, b], False
    )
    assert calls == []
    assert (mels[0] - want_a).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="different positions"):
        flow.encoder.forward_rows(torch.zeros(2, 4, 1), None, [a.encoder, b.encoder], True)


def test_utterances_forked_from_one_voice_share_its_prefix_without_a_copy(flow, tts_golden):
    """Each utterance forks the voice's cache itself (its own view of the same frames); the batched
    attention reads that one prefix expanded over the rows instead of concatenating a copy per row."""
    voice = golden_flow_voice(flow, tts_golden)
    pad = -tts_golden["in_prompt_token"].shape[1] % GRID
    flow.stream_step(tts_golden["in_token"][:, : pad + 25 + LOOKAHEAD], voice, finalize=False)
    states = [voice.clone() for _ in range(ROWS)]
    layers = [s.encoder.layers[0] for s in states]
    assert layers[0].prefix_keys is not layers[1].prefix_keys  # separate views
    stacked = stacked_prefix(layers)
    assert stacked is not None and stacked[0].shape[0] == ROWS
    assert stacked[0].stride(0) == 0 and stacked[0].data_ptr() == layers[0].prefix_keys.data_ptr()  # no copy
    other = golden_flow_voice(flow, tts_golden)
    flow.stream_step(tts_golden["in_token"][:, : pad + 25 + LOOKAHEAD], other, finalize=False)
    mixed = stacked_prefix([layers[0], other.clone().encoder.layers[0]])  # two voices: stacked copies
    assert mixed is not None and mixed[0].stride(0) != 0
    assert torch.equal(mixed[0][1:], other.encoder.layers[0].keys[:, :, : other.encoder.layers[0].length])
