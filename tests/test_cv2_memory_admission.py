"""Memory admission (`[engine] max_streaming`): on a GPU the flow contexts (every Euler step's K/V of every
frame, ~115 MB per second of speech in bf16) bound how many utterances can stream at once, so at most
`max_streaming` utterances hold them; the others wait their turn and then speak in full, rather than a
batch running the device out of memory (32 at once on an 80 GB H100, 2026-11-27). Auto (0) sizes the cap
from the memory free after warm-up on a GPU, and sets none on a CPU."""

from __future__ import annotations

import pytest
import torch
from cv2_engine_helpers import GOLDEN_VOICE, build_speaking_model_dir, load_speaking_model, make_backend
from engine_helpers import EventLog, RecordingSink

from voicertc.backends.cosyvoice.serve.backend import ADMISSION_HEADROOM, streaming_cap
from voicertc.config import ConfigError, EngineConfig
from voicertc.engine import Done, FirstAudio
from voicertc.engine.worker import EngineWorker

TEXT = "Zebras quietly jump over seven lazy dogs."
UTTERANCES = ["u1", "u2", "u3", "u4"]


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory):
    torch.set_num_threads(2)
    return load_speaking_model(
        build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("cv2_admission"))
    )


def _peak_in_flight(
    cap: int, model, golden_dir, **options: object
) -> tuple[int, EventLog, dict[str, RecordingSink]]:
    """Four utterances said at once; the most that had audio out and were not done at any moment."""
    backend = make_backend(model, golden_dir, **{"max_segment_tokens": 40, "max_streaming": cap, **options})
    engine = EngineWorker(backend, default_voice=GOLDEN_VOICE)
    log, sinks = EventLog(), {}
    engine.start()
    try:
        for uid in UTTERANCES:
            sinks[uid] = RecordingSink()
            engine.open_utterance(GOLDEN_VOICE, sinks[uid], log, utterance_id=uid)
            engine.push_text(uid, TEXT, end=True)
        log.wait_terminal(UTTERANCES, timeout_s=300)
        assert backend.streaming == 0  # every admission returned
    finally:
        engine.stop()
    live, peak = set(), 0
    for event in log.events:
        if isinstance(event, FirstAudio):
            live.add(event.utterance_id)
            peak = max(peak, len(live))
        elif isinstance(event, Done):
            live.discard(event.utterance_id)
    return peak, log, sinks


def test_at_most_max_streaming_utterances_stream_and_the_rest_speak_after(model, golden_dir):
    peak, log, sinks = _peak_in_flight(2, model, golden_dir)
    assert peak <= 2
    for uid in UTTERANCES:
        assert [type(e) for e in log.of(uid) if isinstance(e, Done)] == [Done]
        assert sinks[uid].samples(uid).size > 0  # the waiting ones spoke in full too
    unlimited, _, _ = _peak_in_flight(0, model, golden_dir)  # CPU, auto: no cap
    assert unlimited > 2  # the same load without admission: the bound above is the cap's doing


def test_a_batch_has_its_chunk_room_before_it_saves_its_states(model, golden_dir, monkeypatch):
    """A batched chunk's members hold room for the chunk when it starts (`CausalFlow.reserve_stream`,
    made before the backend saves their states for a retry): no context moves to a larger tensor while
    a saved copy holds the old one (`tests/test_flow_saved_states.py`), on the GPU serving path."""
    room_left: list[int] = []
    start = model.flow.start_stream_batch

    def checking(new_tokens, states, finalize):
        for tokens, state in zip(new_tokens, states, strict=True):
            adds = 2 * (state.pending_prompt.shape[1] + tokens.shape[1] - (0 if finalize else 3))
            for cache in state.estimator:
                packed = cache.packed
                if len(states) > 1 and packed is not None:
                    room_left.append(packed.kv.shape[4] - packed.own_frames - adds)
        return start(new_tokens, states, finalize)

    monkeypatch.setattr(model.flow, "start_stream_batch", checking)
    _peak_in_flight(0, model, golden_dir, static_steps=True, max_segment_tokens=150)  # past the first room
    assert room_left and min(room_left) >= 0


def test_auto_cap_is_the_free_memory_over_the_room_each_needs():
    per_s = 115 * 2**20  # bf16 full-size CosyVoice2: bytes of flow context per second of speech
    free = 60 * 2**30
    # each utterance's room: its frames, a quarter more and 128 frames (2.56 s) of growth
    room_s = 30.0 * 1.25 + 128 / 50
    assert streaming_cap(free, per_s, 30.0) == int(free * (1 - ADMISSION_HEADROOM) / (per_s * room_s)) == 11
    assert streaming_cap(free, per_s, 10.0) == 30
    assert streaming_cap(1.0, per_s, 30.0) == 1  # never 0: one utterance always streams
    with pytest.raises(ValueError, match="positive"):
        streaming_cap(free, 0.0, 30.0)


def test_cpu_auto_sets_no_cap(model, golden_dir):
    backend = make_backend(model, golden_dir, max_streaming=0)
    backend.warm_up()
    assert backend.streaming_cap is None
    backend.close()


@pytest.mark.parametrize(("key", "value"), [("max_streaming", -1), ("streaming_context_s", 0.5)])
def test_bad_admission_keys_are_named(key, value):
    with pytest.raises(ConfigError, match=f"engine.{key}"):
        EngineConfig(**{key: value}).validate()
