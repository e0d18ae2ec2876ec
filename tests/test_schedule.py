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
