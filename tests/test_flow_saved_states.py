"""A batched flow chunk's saved states (the retry copies `CosyVoice2Backend._flow_group` keeps until the
chunk ends) cost no memory of their own: the room each context needs for the chunk is made before the
save (`CausalFlow.reserve_stream`), so no context moves to a larger tensor while a saved copy still
holds the old one. Moved during the chunk, every growing context was held twice until the chunk ended,
all of them at once for utterances that started together (32 such ran an H100 out of memory)."""

from __future__ import annotations

import torch
from flow_stream_helpers import GRID, LOOKAHEAD, golden_flow_voice

from voicertc.backends.cosyvoice.flow.captured import Buckets, CapturedEstimator
from voicertc.backends.cosyvoice.flow.graph import StreamingEstimator
from voicertc.backends.cosyvoice.flow.unet import PackedCache


def _packed(state) -> list[PackedCache]:
    caches = [cache.packed for cache in state.estimator]
    assert all(packed is not None for packed in caches)
    return caches  # type: ignore[return-value]


def _second_chunk(flow, tts_golden, reserve: bool) -> tuple[list, list]:
    """Two utterances' first chunks, then their second (larger: it outgrows the first's room) as one
    batch, the states saved before it as the backend saves them; (live, saved) states after it."""
    tokens, voice = tts_golden["in_token"], golden_flow_voice(flow, tts_golden)
    first = -tts_golden["in_prompt_token"].shape[1] % GRID + 25
    states = [voice.clone(), voice.clone()]
    flow.stream_step_batch([tokens[:, : first + LOOKAHEAD]] * 2, states, finalize=False)
    second = [tokens[:, first : first + 100 + LOOKAHEAD]] * 2  # 200 new frames: past the first's room
    if reserve:
        flow.reserve_stream(second, states, finalize=False)
    saved = [state.clone() for state in states]
    flow.advance_stream(flow.start_stream_batch(second, states, finalize=False))
    return states, saved


def _run(flow, tts_golden, reserve: bool) -> tuple[list, list]:
    flow.decoder.estimator_runner = CapturedEstimator(
        StreamingEstimator(flow.decoder.estimator), buckets=Buckets(max_rows=8)
    )
    try:
        return _second_chunk(flow, tts_golden, reserve)
    finally:
        flow.decoder.estimator_runner = None


def test_a_saved_state_shares_the_room_its_chunk_is_written_into(flow, tts_golden):
    live, saved = _run(flow, tts_golden, reserve=True)
    for live_state, saved_state in zip(live, saved, strict=True):
        for now, before in zip(_packed(live_state), _packed(saved_state), strict=True):
            assert now.frames > before.frames  # the chunk was written ...
            assert now.kv.data_ptr() == before.kv.data_ptr()  # ... into the tensor the save holds
            assert now.own_frames <= now.kv.shape[4]


def test_without_the_room_made_first_the_save_holds_a_tensor_the_chunk_left(flow, tts_golden):
    """The same run without the reservation (what the backend did): the chunk outgrows the room, the
    contexts move during it and the saved states keep the old tensors alive (so the test above is not
    passing on a chunk that never grows)."""
    live, saved = _run(flow, tts_golden, reserve=False)
    moved = [
        now.kv.data_ptr() != before.kv.data_ptr()
        for live_state, saved_state in zip(live, saved, strict=True)
        for now, before in zip(_packed(live_state), _packed(saved_state), strict=True)
    ]
    assert moved and all(moved)


def test_reserve_stream_counts_the_frames_the_chunk_adds(flow, tts_golden):
    voice = golden_flow_voice(flow, tts_golden)
    pending = voice.pending_prompt.shape[1]
    new = torch.zeros(1, 40, dtype=torch.long)
    for finalize, frames in ((False, 2 * (pending + 40 - LOOKAHEAD)), (True, 2 * (pending + 40))):
        asked: list[int] = []
        state = voice.clone()
        state.reserve = asked.append  # type: ignore[method-assign]
        flow.reserve_stream([new], [state], finalize=finalize)
        assert asked == [frames]
