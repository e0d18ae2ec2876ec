"""ChunkSchedule is pure: hops, prompt padding, readiness; every utterance starts at the first hop."""

from __future__ import annotations

import pytest

from voicertc.engine import ChunkSchedule


def test_default_hops_grow_then_cap():
    s = ChunkSchedule()
    assert [s.hop_tokens(i) for i in range(5)] == [25, 50, 100, 100, 100]


def test_prompt_padding_puts_chunk_ends_on_the_grid():
    s = ChunkSchedule()
    for prompt in range(0, 80):
        pad = s.prompt_pad_tokens(prompt)
        assert 0 <= pad < 25
        for i in range(4):
            assert (prompt + s.chunk_end_tokens(i, prompt)) % 25 == 0


def test_reference_sequence_for_a_17_token_prompt():
    # golden cv2_tts record: prompt 17 tokens -> chunks of 33, 50, 100 new tokens
    s = ChunkSchedule()
    ends = [s.chunk_end_tokens(i, 17) for i in range(3)]
    assert ends == [33, 83, 183]
    assert not s.ready(0, 17, 35) and s.ready(0, 17, 36)


def test_hundred_sequential_utterances_start_with_the_first_hop():
    s = ChunkSchedule()
    for _ in range(100):
        assert s.chunk_end_tokens(0, 0) == 25  # nothing is stored on the schedule between uses


def test_custom_schedule_and_validation():
    s = ChunkSchedule(first_hop_tokens=10, growth=3, max_hop_tokens=50, lookahead_tokens=0)
    assert [s.hop_tokens(i) for i in range(4)] == [10, 30, 50, 50]
    with pytest.raises(ValueError, match="max_hop_tokens"):
        ChunkSchedule(first_hop_tokens=30, max_hop_tokens=20)
    with pytest.raises(AttributeError):
        s.growth = 4  # frozen


def test_grid_schedule_with_the_reference_hop_is_the_reference():
    reference, grid = ChunkSchedule(), ChunkSchedule(grid_tokens=25)
    for prompt in range(0, 120):
        assert [grid.chunk_end_tokens(i, prompt) for i in range(5)] == [
            reference.chunk_end_tokens(i, prompt) for i in range(5)
        ]


def test_short_first_hop_ends_on_the_next_grid_point():
    """first_hop_tokens=13 on the 25-token grid: the first chunk holds 13..37 new tokens (the reference
    25..49), ends on the grid, and the later hops are the reference's 50, 100, 100."""
    s = ChunkSchedule(first_hop_tokens=13, grid_tokens=25)
    reference = ChunkSchedule()
    firsts = []
    for prompt in range(0, 120):
        ends = [s.chunk_end_tokens(i, prompt) for i in range(4)]
        assert all((prompt + end) % 25 == 0 for end in ends)
        assert 13 <= ends[0] <= 37 and ends[0] <= reference.chunk_end_tokens(0, prompt)
        assert [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)] == [50, 100, 100]
        firsts.append(ends[0])
    assert s.chunk_end_tokens(0, 60) == 15 and ChunkSchedule().chunk_end_tokens(0, 60) == 40
    reference_firsts = [reference.chunk_end_tokens(0, p) for p in range(120)]
    assert sum(firsts) / len(firsts) < 26 < 36 < sum(reference_firsts) / len(reference_firsts)
    with pytest.raises(ValueError, match="grid_tokens"):
        ChunkSchedule(grid_tokens=0)
