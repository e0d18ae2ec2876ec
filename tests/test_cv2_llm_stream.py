"""`[engine] llm = "thread"`: the speech LLM on its own thread, its tokens streamed into the engine.

The seam the vLLM runner plugs into (`llm_stream.SpeechTokenStreamer`), proven with our own torch LLM:
the streamer draws the tokens the engine thread would draw for the same prompt and seed, an engine fed
by it says the same audio as one decoding itself, a cancel frees the streamer's row, and a streamer
failure fails only its utterance.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from cv2_engine_helpers import (
    GOLDEN_VOICE,
    build_speaking_model_dir,
    golden_voice,
    load_speaking_model,
    record_speech_tokens,
)
from engine_helpers import EventLog, RecordingSink

from voicertc.backends.cosyvoice.llm.streamer import ThreadedSpeechLlm
from voicertc.backends.cosyvoice.serve.backend import BackendOptions, CosyVoice2Backend
from voicertc.engine import Cancelled, Done, Failed, FirstAudio
from voicertc.engine.worker import EngineWorker

TEXT = "Quiet rivers run past the old mill."


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory):
    model_dir = build_speaking_model_dir(
        tiny_model_dir, golden_dir, tmp_path_factory.mktemp("cv2_stream_llm")
    )
    return load_speaking_model(model_dir)


def _backend(model, golden_dir, streamer=None, **options) -> CosyVoice2Backend:
    opts = BackendOptions(**{"seed": 1234, "max_segment_tokens": 60, **options})  # type: ignore[arg-type]
    backend = CosyVoice2Backend(model, options=opts, streamer=streamer)
    backend.add_voice(golden_voice(model, golden_dir), persist=False)
    if streamer is not None:
        streamer.start()
    return backend


def _say(backend: CosyVoice2Backend, texts: dict[str, str], cancel_after_first: str = ""):
    engine = EngineWorker(backend, default_voice=GOLDEN_VOICE)
    log, sinks = EventLog(), {}
    engine.start()
    try:
        for uid, text in texts.items():
            sinks[uid] = RecordingSink()
            engine.open_utterance(GOLDEN_VOICE, sinks[uid], log, utterance_id=uid)
            engine.push_text(uid, text, end=True)
        if cancel_after_first:
            deadline = time.monotonic() + 120
            while not any(isinstance(e, FirstAudio) for e in log.of(cancel_after_first)):
                assert time.monotonic() < deadline, "no first audio"
                time.sleep(0.01)
            engine.cancel(cancel_after_first)
        log.wait_terminal(list(texts), timeout_s=300)
    finally:
        engine.stop()
    return log, sinks


def test_the_streamer_draws_the_tokens_of_the_engine_thread(model):
    llm = model.llm
    text = model.text_frontend.encode(TEXT)
    local = llm.prefill(text, generator=torch.Generator().manual_seed(77))
    expected = []
    while (token := llm.step(local)) is not None:
        expected.append(token)
    streamer = ThreadedSpeechLlm(llm)
    got: list[object] = []
    done = threading.Event()

    def sink(item):
        got.append(item)
        if not isinstance(item, int):
            done.set()

    streamer.start()
    try:
        streamer.submit("r1", llm.lm_input(text)[0], local.min_len, local.max_len, sink, seed=77)
        assert done.wait(60)
    finally:
        streamer.stop()
    assert got == [*expected, None]
    assert streamer.pool.in_use == 0


def test_an_engine_fed_by_the_streamer_says_what_the_engine_thread_says(model, golden_dir, monkeypatch):
    texts = {"a": TEXT, "b": "Seven bright lamps lit the harbour.", "c": "Bread."}
    seen = record_speech_tokens(monkeypatch)
    local_log, local_sinks = _say(_backend(model, golden_dir), texts)
    local_tokens = sorted(seen.values())
    seen.clear()
    streamer = ThreadedSpeechLlm(model.llm)
    backend = _backend(model, golden_dir, streamer)
    stream_log, stream_sinks = _say(backend, texts)
    backend.close()
    assert sorted(seen.values()) == local_tokens  # the same speech tokens, utterance by utterance
    for uid in texts:
        assert [type(e) for e in stream_log.of(uid)] == [FirstAudio, Done]
        expected, got = local_sinks[uid].samples(uid), stream_sinks[uid].samples(uid)
        assert got.size == expected.size > 0
        # the flow batches differently (tokens arrive on another clock): batched == alone to ~1e-3
        np.testing.assert_allclose(got, expected, atol=2e-3)
    assert streamer.steps > 0 and streamer.pool.in_use == 0
    assert backend.stats["decode_rows"] == 0  # every token came from the streamer


def test_a_cancel_frees_the_streamer_row(model, golden_dir):
    streamer = ThreadedSpeechLlm(model.llm)
    backend = _backend(model, golden_dir, streamer, max_segment_tokens=400)
    long_text = " ".join([TEXT] * 3)
    log, _ = _say(backend, {"long": long_text, "short": "Bread."}, cancel_after_first="long")
    assert isinstance(log.of("long")[-1], Cancelled)
    assert isinstance(log.of("short")[-1], Done)
    deadline = time.monotonic() + 30
    while streamer.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert streamer.active == 0 and streamer.pool.in_use == 0
    backend.close()


class _FailingFor(ThreadedSpeechLlm):
    def __init__(self, llm, bad: str) -> None:
        super().__init__(llm)
        self.bad = bad

    def _open(self, request_id, *args):
        if request_id.startswith(self.bad):
            raise RuntimeError("no room on the LLM server")
        return super()._open(request_id, *args)


@pytest.mark.expected_errors("no room on the LLM server")
def test_a_streamer_failure_fails_only_its_utterance(model, golden_dir):
    streamer = _FailingFor(model.llm, bad="bad/")
    backend = _backend(model, golden_dir, streamer)
    log, sinks = _say(backend, {"bad": TEXT, "good": TEXT})
    backend.close()
    failed = log.of("bad")[-1]
    assert isinstance(failed, Failed) and "no room on the LLM server" in failed.message
    assert isinstance(log.of("good")[-1], Done) and sinks["good"].samples("good").size > 0
