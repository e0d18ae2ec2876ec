"""In-process WebRTC loopback with the cosyvoice2 backend on the tiny model: its speech crosses aiortc
(Opus, 48 kHz) and the track's playout of the utterance matches what the engine produced."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cv2_engine_helpers import GOLDEN_VOICE, build_speaking_model_dir, load_speaking_model, make_backend
from test_loopback import Receiver, connect, loopback_ice, rms  # noqa: F401 - loopback_ice is a fixture

from voicertc.audio import PcmRing, RingSink
from voicertc.engine import Done
from voicertc.engine.worker import EngineWorker
from voicertc.webrtc import PlayoutEvent, SpeechTrack

TEXT = "Zebras quietly jump over seven lazy dogs near Mount Vesuvius today."


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory):
    torch.set_num_threads(2)
    return load_speaking_model(
        build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("cv2_loop"))
    )


async def test_cosyvoice2_engine_speaks_through_the_track(loopback_ice, model, golden_dir):  # noqa: F811
    ring = PcmRing(high_water_ms=1000.0)
    sink = RingSink(ring)
    playout: list[PlayoutEvent] = []
    track = SpeechTrack(ring, on_playout=playout.append)
    engine_events = []
    engine = EngineWorker(make_backend(model, golden_dir, max_segment_tokens=75), default_voice=GOLDEN_VOICE)
    engine.start()
    client = server = receiver = None
    try:
        client, server, remote = await connect(track)
        receiver = Receiver(remote)
        await receiver.wait_for(lambda: len(receiver.frames) >= 5)
        utterance_id = engine.say(None, sink, engine_events.append, TEXT)
        await receiver.wait_for(lambda: any(e.kind == "done" for e in playout), timeout_s=120)
        done = [e for e in engine_events if isinstance(e, Done)]
        assert len(done) == 1 and done[0].utterance_id == utterance_id
        assert done[0].audio_ms == pytest.approx(75 * 40.0)  # 75 speech tokens at 25 Hz
        played = [e for e in playout if e.kind == "done"]
        assert [e.utterance_id for e in played] == [utterance_id]
        assert played[0].played_ms == pytest.approx(done[0].audio_ms, abs=2.0)
        loud = receiver.loud()
        assert receiver.sample_rates == {48000}
        assert len(loud) >= 0.5 * done[0].audio_ms / 20  # most 20 ms frames carry the tiny model's speech
        assert rms(np.concatenate([pcm for _, pcm in loud])) > 3e-3
    finally:
        engine.stop()
        if receiver is not None:
            await receiver.close()
        for pc in (client, server):
            if pc is not None:
                await pc.close()
