"""CosyVoice3's fixed excitation noise (`hift.source_causal.NoiseBuffers`): values by absolute sample
position (block b drawn from seed + 1 + b), each one-second block drawn once however many streams read
it, at most `CACHED_BLOCKS` kept, an injected prefix continued with our own blocks."""

from __future__ import annotations

import torch

from voicertc.backends.cosyvoice.hift.source_causal import CACHED_BLOCKS, NOISE_BLOCK_SAMPLES, NoiseBuffers

H = 9


def _block(seed: int, index: int) -> torch.Tensor:
    return torch.rand(1, NOISE_BLOCK_SAMPLES, H, generator=torch.Generator().manual_seed(seed + 1 + index))


def test_noise_is_the_seeded_blocks_at_absolute_positions():
    buffers = NoiseBuffers(H, seed=11)
    expected = torch.cat([_block(11, b) for b in range(3)], dim=1)
    for start, end in [(0, 10), (23_990, 24_010), (100, 60_000), (48_000, 72_000), (5, 5)]:
        assert torch.equal(buffers.noise(start, end), expected[:, start:end])


def test_streams_reading_the_same_positions_draw_each_block_once():
    buffers = NoiseBuffers(H)
    for _ in range(4):  # four streams, chunk by chunk over their first 2.5 s
        for start in range(0, 60_000, 9_600):
            buffers.noise(start, start + 9_600)
    assert buffers.drawn_blocks == 3


def test_the_cache_is_bounded_and_evicted_blocks_come_back_equal():
    buffers = NoiseBuffers(H, seed=3)
    first = buffers.noise(0, 100).clone()
    for b in range(CACHED_BLOCKS + 10):
        buffers.noise(b * NOISE_BLOCK_SAMPLES, b * NOISE_BLOCK_SAMPLES + 1)
    assert len(buffers._blocks) == CACHED_BLOCKS
    drawn = buffers.drawn_blocks
    assert torch.equal(buffers.noise(0, 100), first) and buffers.drawn_blocks == drawn + 1


def test_an_injected_prefix_continues_with_our_blocks():
    buffers = NoiseBuffers(H, seed=5)
    prefix = torch.full((1, 30_000, H), 0.5)
    buffers.set(torch.zeros(1, H), prefix)
    got = buffers.noise(29_990, 30_010)
    assert torch.equal(got[:, :10], prefix[:, -10:])
    assert torch.equal(
        got[:, 10:], _block(5, 1)[:, 30_000 - NOISE_BLOCK_SAMPLES : 30_010 - NOISE_BLOCK_SAMPLES]
    )
