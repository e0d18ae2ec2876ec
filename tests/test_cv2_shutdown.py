"""Shutdown while CosyVoice2 is busy: the engine thread ends within its timeout (issue 24, item 1).

Busy means a long speed-0.9 utterance (its flow runs in bounded full-attention windows), a long text
still being normalised in the text process, and a voice registration whose features are being
computed: none of them may hold the engine thread, and every caller gets an answer.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cv2_engine_helpers import GOLDEN_VOICE, build_speaking_model_dir, load_speaking_model, make_backend
from engine_helpers import EventLog, RecordingSink

from voicertc.audio.decode import Clip
from voicertc.engine import Cancelled
from voicertc.engine.protocol import SpeakOptions
from voicertc.engine.worker import EngineWorker
from voicertc.errors import EngineStoppedError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory):
    return load_speaking_model(
        build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("m"))
    )


def test_stop_ends_the_engine_thread_within_its_timeout_whatever_it_was_doing(
    model, golden_dir, tmp_path, caplog
):
    before = {p.pid for p in multiprocessing.active_children()}  # other tests' in this worker process
    backend = make_backend(
        model, golden_dir, tmp_path / "voices",
        text_workers=1, max_segment_tokens=600, speed_window_tokens=100,
    )  # fmt: skip
    engine = EngineWorker(backend, name="cv2-shutdown")
    engine.start()
    pool_children = {p.pid for p in multiprocessing.active_children()} - before
    log = EventLog()
    slow = engine.open_utterance(GOLDEN_VOICE, RecordingSink(), log, options=SpeakOptions(speed=0.9))
    engine.push_text(slow, "This long utterance is spoken slowly, in many bounded windows. " * 40, end=True)
    digits = engine.open_utterance(GOLDEN_VOICE, RecordingSink(), log)
    engine.push_text(digits, "我有" + "1234567890" * 400, end=True)
    rate = 16000
    t = np.arange(8 * rate) / rate
    clip = Clip((0.3 * np.sin(2 * np.pi * 170 * t)).astype(np.float32), rate)
    registering = engine.register_voice(clip, "A voice registered during shutdown.", "late", "")
    while engine.step_stats.steps < 20:  # well into the slow utterance's LLM decode
        time.sleep(0.05)  # (a wait on no utterances returned at once: this loop spun, starving the engine)
    with caplog.at_level(logging.ERROR, logger="voicertc.engine.worker"):
        engine.stop(timeout_s=10.0)
    assert not engine.running, "the engine thread is still running after stop()"
    assert "did not stop" not in caplog.text
    assert all(isinstance(log.of(uid)[-1], Cancelled) for uid in (slow, digits))
    try:  # registered before the stop, or refused because of it: an answer either way
        assert registering.result(30)["id"] == "late"
    except EngineStoppedError:
        pass
    for pid in pool_children:  # the text process goes with its backend
        assert _ended(pid, within_s=30), f"text process {pid} still running after stop()"


def _ended(pid: int, within_s: float) -> bool:
    """The process is gone or a zombie. Not `Process.is_alive()`: the pool's manager thread reaps it too,
    and a Process whose waitpid lost that race reports itself alive forever."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False
