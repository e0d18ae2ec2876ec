"""Incremental flow (init_stream / stream_step): cached chunks equal the golden streaming chunks and the
chunk-masked whole-utterance mel, for several hop schedules, with causality and batching checks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.testing import assert_close

from voicertc.backends.cosyvoice.flow import flow as flow_module
from voicertc.backends.cosyvoice.flow.flow import CausalFlow, FlowStreamState
from voicertc.backends.cosyvoice.flow.kv import MOVE_RATE

ATOL = 1e-4
RTOL = 1e-4
LOOKAHEAD = 3
GRID = 25


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


def _stream(
    flow: CausalFlow, tokens: torch.Tensor, state: FlowStreamState, prompt_len: int, hop: Callable[[int], int]
) -> list[torch.Tensor]:
    """Run the whole utterance chunk by chunk; the first chunk carries the grid pad."""
    n, offset, index, mels = tokens.shape[1], 0, 0, []
    pad = -prompt_len % GRID
    while True:
        this_hop = hop(index) + (pad if index == 0 else 0)
        if offset + this_hop + LOOKAHEAD > n:
            break
        mels.append(
            flow.stream_step(tokens[:, offset : offset + this_hop + LOOKAHEAD], state, finalize=False)
        )
        assert mels[-1].shape == (1, 80, 2 * this_hop)
        offset, index = offset + this_hop, index + 1
    mels.append(flow.stream_step(tokens[:, offset:], state, finalize=True))
    return mels


def _inputs(g: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return g["in_token"], g["in_prompt_token"], g["in_prompt_feat"], g["in_embedding"]


def test_chunks_equal_official_streaming_chunks(flow, tts_golden, golden):
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(tts_golden)
    state = flow.init_stream(prompt_tokens, prompt_feat, embedding)
    mels = _stream(flow, tokens, state, prompt_tokens.shape[1], lambda i: min(100, 25 * 2**i))
    assert len(mels) == 4
    for call in range(3):
        assert_close(
            mels[call], tts_golden[f"stream_call{call}_flow_mel_after_offset_cut"], atol=ATOL, rtol=RTOL
        )
    # the last chunk stays chunk-masked (the reference switches to full attention there)
    assert_close(torch.cat(mels, dim=2), golden["chunkmask_mel"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("hop_tokens", [25, 50, 100])
def test_fixed_hops_equal_chunk_masked_whole(flow, golden, hop_tokens):
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(golden)
    state = flow.init_stream(prompt_tokens, prompt_feat, embedding)
    mels = _stream(flow, tokens, state, prompt_tokens.shape[1], lambda i: hop_tokens)
    assert_close(torch.cat(mels, dim=2), golden["chunkmask_mel"], atol=ATOL, rtol=RTOL)


def test_long_prompt_is_precomputed_once(flow, golden):
    """A 60-token prompt: its first two grid chunks are encoded by init_stream, the rest pends."""
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(golden)
    long_prompt = torch.cat([prompt_tokens, tokens[:, 157:200]], dim=1)
    long_feat = torch.cat([prompt_feat, golden["chunkmask_mel"][:, :, -86:].transpose(1, 2)], dim=1)
    speech = tokens[:, :150]
    state = flow.init_stream(long_prompt, long_feat, embedding)
    assert state.encoder.tokens == 50 and state.frames == 100
    voice, voice_again = state.clone(), state.clone()
    mels = _stream(flow, speech, state, long_prompt.shape[1], lambda i: 50)
    whole = flow.infer(speech, long_prompt, long_feat, embedding, streaming=True, finalize=True)
    assert_close(torch.cat(mels, dim=2), whole, atol=ATOL, rtol=RTOL)
    # the saved voice state is untouched by the utterance and gives the same result again (the clones
    # attend over the prompt prefix and their own frames separately: equal up to float rounding)
    again = _stream(flow, speech, voice, long_prompt.shape[1], lambda i: 50)
    assert_close(torch.cat(again, dim=2), torch.cat(mels, dim=2), atol=ATOL, rtol=RTOL)
    once_more = _stream(flow, speech, voice_again, long_prompt.shape[1], lambda i: 50)
    assert_close(torch.cat(once_more, dim=2), torch.cat(again, dim=2), atol=0.0, rtol=0.0)


def test_causality_earlier_chunks_ignore_later_tokens(flow, golden):
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(golden)
    first = flow.init_stream(prompt_tokens, prompt_feat, embedding)
    head = flow.stream_step(tokens[:, :36], first, finalize=False)
    fork = first.clone()
    rest_a = flow.stream_step(tokens[:, 33:86], first, finalize=False)
    other = torch.flip(tokens[:, 36:], dims=[1])
    changed = torch.cat([tokens[:, :36], other], dim=1)
    rest_b = flow.stream_step(changed[:, 33:86], fork, finalize=False)
    assert not torch.allclose(rest_a[:, :, -20:], rest_b[:, :, -20:])
    # the chunk-masked reference over different futures agrees on the first chunk's frames
    whole_a = flow.infer(tokens, prompt_tokens, prompt_feat, embedding, streaming=True, finalize=True)
    whole_b = flow.infer(changed, prompt_tokens, prompt_feat, embedding, streaming=True, finalize=True)
    assert_close(whole_a[:, :, :66], whole_b[:, :, :66], atol=1e-5, rtol=0.0)
    assert_close(head, whole_a[:, :, :66], atol=ATOL, rtol=RTOL)


def test_off_grid_chunk_is_rejected(flow, golden):
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(golden)
    state = flow.init_stream(prompt_tokens, prompt_feat, embedding)
    with pytest.raises(ValueError, match="grid"):
        flow.stream_step(tokens[:, :28], state, finalize=False)  # 17 + 25 = 42: off the grid


def test_finalized_stream_rejects_more(flow, golden):
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(golden)
    state = flow.init_stream(prompt_tokens, prompt_feat, embedding)
    flow.stream_step(tokens[:, :10], state, finalize=True)
    with pytest.raises(ValueError, match="finalized"):
        flow.stream_step(tokens[:, 10:20], state, finalize=True)


def test_batched_equals_unbatched(flow, golden):
    """Two voices at different positions (17-token prompt vs a 40-token one with 25 precomputed)."""
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(golden)
    prompt_b = torch.cat([prompt_tokens, tokens[:, 177:200]], dim=1)
    feat_b = torch.cat([prompt_feat, golden["chunkmask_mel"][:, :, -46:].transpose(1, 2)], dim=1)
    speech_a, speech_b = tokens[:, :120], torch.flip(tokens[:, :122], dims=[1])
    embedding_b = -embedding
    # first chunk: A = 17 pending + 33 new, B = 15 pending + 35 new; both 50 tokens, both end on the grid
    plan_a = [(0, 36, False), (33, 86, False), (83, 120, True)]
    plan_b = [(0, 38, False), (35, 88, False), (85, 122, True)]

    def run(batched: bool) -> list[list[torch.Tensor]]:
        state_a = flow.init_stream(prompt_tokens, prompt_feat, embedding)
        state_b = flow.init_stream(prompt_b, feat_b, embedding_b)
        outs: list[list[torch.Tensor]] = [[], []]
        for (a0, a1, fin), (b0, b1, _) in zip(plan_a, plan_b, strict=True):
            pieces = [speech_a[:, a0:a1], speech_b[:, b0:b1]]
            if batched:
                mels = flow.stream_step_batch(pieces, [state_a, state_b], finalize=fin)
            else:
                mels = [flow.stream_step(pieces[0], state_a, fin), flow.stream_step(pieces[1], state_b, fin)]
            for i in range(2):
                outs[i].append(mels[i])
        return outs

    batched, single = run(True), run(False)
    for i in range(2):
        assert_close(torch.cat(batched[i], dim=2), torch.cat(single[i], dim=2), atol=ATOL, rtol=RTOL)
    whole_b = flow.infer(speech_b, prompt_b, feat_b, embedding_b, streaming=True, finalize=True)
    assert_close(torch.cat(batched[1], dim=2), whole_b, atol=ATOL, rtol=RTOL)


def test_batched_rejects_unequal_chunks(flow, golden):
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(golden)
    states = [flow.init_stream(prompt_tokens, prompt_feat, embedding) for _ in range(2)]
    with pytest.raises(ValueError, match="same number"):
        flow.stream_step_batch([tokens[:, :36], tokens[:, :61]], states, finalize=False)


def test_chunk_computes_only_its_own_frames(flow, golden):
    """The point of the caches: chunk k runs the encoder and estimator on its own tokens/frames only."""
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(golden)
    state = flow.init_stream(prompt_tokens, prompt_feat, embedding)
    flow.stream_step(tokens[:, :36], state, finalize=False)
    seen: list[tuple[str, int]] = []
    handles = [
        flow.encoder.register_forward_hook(lambda m, args, out: seen.append(("encoder", args[0].shape[1]))),
        flow.decoder.estimator.register_forward_hook(
            lambda m, args, out: seen.append(("estimator", args[0].shape[2]))
        ),
    ]
    try:
        before = state.cache_bytes()
        flow.stream_step(tokens[:, 33:86], state, finalize=False)
    finally:
        for handle in handles:
            handle.remove()
    assert seen == [("encoder", 50)] + [("estimator", 100)] * 10
    assert state.frames == 2 * (17 + 83) and state.encoder.tokens == 17 + 83
    assert state.cache_bytes() > before


@pytest.fixture(params=["reserved", "growing"])
def kv_reserve(request, monkeypatch) -> str:
    """Both K/V capacity policies: room reserved up front (CPU default) and grown from small buffers."""
    if request.param == "growing":
        monkeypatch.setattr(flow_module, "CPU_KV_RESERVE_TOKENS", 0)
    return request.param


def test_voice_state_cloned_twice_is_not_aliased(flow, golden, kv_reserve):
    """A voice's prompt state is cloned per utterance; clones stream in place without touching the
    voice or each other (the K/V buffers are shared copy-on-write)."""
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(golden)
    long_prompt = torch.cat([prompt_tokens, tokens[:, 157:200]], dim=1)
    long_feat = torch.cat([prompt_feat, golden["chunkmask_mel"][:, :, -86:].transpose(1, 2)], dim=1)
    voice = flow.init_stream(long_prompt, long_feat, embedding)
    voice_kv = [
        (kv.keys[:, :, : kv.length].clone(), kv.values[:, :, : kv.length].clone()) for kv in voice.kv_caches()
    ]  # type: ignore[index]
    first = voice.clone()
    for a, b in zip(first.kv_caches(), voice.kv_caches(), strict=True):  # views of the voice's buffers
        assert a.prefix_keys is not None and b.keys is not None
        assert a.keys is None and a.prefix_keys.data_ptr() == b.keys.data_ptr()
    # 10 pending + 15 new tokens first: small chunks write into the buffers' spare room, where a
    # clone that wrote without copying first would overwrite its siblings' frames
    plan = [(0, 18, False), (15, 43, False), (40, 68, False), (65, 125, True)]
    mels_first = [flow.stream_step(tokens[:, a:b], first, finalize=fin) for a, b, fin in plan]
    second, other = voice.clone(), voice.clone()
    mels_second = []
    for start, end, final in plan:
        mels_second.append(flow.stream_step(tokens[:, start:end], second, finalize=final))
        flow.stream_step(torch.flip(tokens[:, start:end], dims=[1]), other, finalize=final)  # interleaved
    assert_close(torch.cat(mels_second, dim=2), torch.cat(mels_first, dim=2), atol=0.0, rtol=0.0)
    for kv, (keys, values) in zip(voice.kv_caches(), voice_kv, strict=True):
        assert kv.length == keys.shape[2]
        assert torch.equal(kv.keys[:, :, : kv.length], keys) and torch.equal(
            kv.values[:, :, : kv.length], values
        )  # type: ignore[index]


def test_cloned_voice_first_chunk_copies_no_prompt(flow, golden, kv_reserve):
    """The voice's K/V are a read-only prefix of its clones: a clone's first chunk stores only its
    own frames' keys/values (it used to copy the whole prompt history of every attention layer), and
    two utterances of one voice stream independently (interleaved equals alone)."""
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(golden)
    long_prompt = torch.cat([prompt_tokens, tokens[:, 157:200]], dim=1)
    long_feat = torch.cat([prompt_feat, golden["chunkmask_mel"][:, :, -86:].transpose(1, 2)], dim=1)
    voice = flow.init_stream(long_prompt, long_feat, embedding)
    prompt_elements = sum(kv.filled_bytes() for kv in voice.kv_caches()) // 4
    alone = flow.stream_step(tokens[:, :18], voice.clone(), finalize=False)
    first, second = voice.clone(), voice.clone()
    before = sum(kv.written_elements for kv in first.kv_caches())
    mel_second = flow.stream_step(torch.flip(tokens[:, :18], dims=[1]), second, finalize=False)
    mel_first = flow.stream_step(tokens[:, :18], first, finalize=False)
    written = sum(kv.written_elements for kv in first.kv_caches()) - before
    own = sum(kv.filled_bytes() for kv in first.kv_caches()) // 4
    assert 0 < written == own < prompt_elements  # only the chunk's own frames, no prompt copy
    assert_close(mel_first, alone, atol=0.0, rtol=0.0)
    assert not torch.equal(mel_second, mel_first)
    again = flow.stream_step(tokens[:, :18], voice.clone(), finalize=False)
    assert_close(again, alone, atol=0.0, rtol=0.0)  # the voice itself is untouched


def test_chunk_cost_does_not_grow_with_history(flow, golden, kv_reserve):
    """Hop fixed at 25 tokens: the K/V elements a chunk stores (its own frames, plus at most
    MOVE_RATE x as many moved into a grown buffer) do not depend on how many chunks came before;
    appending with torch.cat stored the whole history each chunk (12x chunk 2's at chunk 12)."""
    _, prompt_tokens, prompt_feat, embedding = _inputs(golden)
    gen = torch.Generator().manual_seed(3)
    pad = -prompt_tokens.shape[1] % GRID
    tokens = torch.randint(0, flow.cfg.vocab_size, (1, pad + GRID * 14 + LOOKAHEAD), generator=gen)
    state = flow.init_stream(prompt_tokens, prompt_feat, embedding)
    written, new, offset = [0], [0], 0  # 1-based chunk index
    for index in range(14):
        end = offset + GRID + (pad if index == 0 else 0)
        before_written = sum(kv.written_elements for kv in state.kv_caches())
        before_filled = sum(kv.filled_bytes() for kv in state.kv_caches())
        flow.stream_step(tokens[:, offset : end + LOOKAHEAD], state, finalize=False)
        written.append(sum(kv.written_elements for kv in state.kv_caches()) - before_written)
        new.append((sum(kv.filled_bytes() for kv in state.kv_caches()) - before_filled) // 4)
        offset = end
    if kv_reserve == "growing":
        assert max(written[k] / new[k] for k in range(2, 15)) > 1.5  # some chunks moved frames
    assert len(set(new[2:])) == 1  # every chunk after the first adds the same number of K/V elements
    for k in range(2, 15):
        assert new[k] <= written[k] <= (2 + MOVE_RATE) * new[k]
    assert written[12] <= (2 + MOVE_RATE) * written[2]
    assert sum(written[2:]) <= 4 * sum(new[2:])  # amortised growth cost
