"""`[engine] llm = "thread"` with `cuda_graphs`: the streamer decodes on its own decode graphs, each step
launched before the one before is read (`llm.ahead`; on CUDA on its own stream). On a CPU the graphs are
recorded and replayed (`accel.tape`): the streamer draws, request by request, the tokens the engine's own
decode graphs draw for the same prompt and seed; a request cancelled with a step in flight keeps its row
until that step is read, then frees it, and the others go on; an engine fed by it speaks the tokens the
engine's decode graphs speak."""

from __future__ import annotations

import threading

import pytest
import torch
from cv2_engine_helpers import (
    GOLDEN_VOICE,
    build_speaking_model_dir,
    golden_voice,
    load_speaking_model,
    record_speech_tokens,
)
from decode_helpers import decode_stepped
from engine_helpers import EventLog, RecordingSink

from voicertc.backends.cosyvoice.accel.tape import TapeCapture
from voicertc.backends.cosyvoice.llm.graphs import DecodeGraphs
from voicertc.backends.cosyvoice.llm.kv import SlotKV
from voicertc.backends.cosyvoice.llm.qwen2lm import LlmSession
from voicertc.backends.cosyvoice.llm.streamer import ThreadedSpeechLlm
from voicertc.backends.cosyvoice.serve.backend import BackendOptions, CosyVoice2Backend
from voicertc.engine import Done, FirstAudio
from voicertc.engine.worker import EngineWorker

TEXTS = ["Quiet rivers run past the old mill.", "Seven bright lamps.", "Bread and salt for the road."]


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model(tiny_model_dir, golden_dir, tmp_path_factory):
    model_dir = build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("cv2_graphs"))
    return load_speaking_model(model_dir)


def _requests(model) -> list[tuple[torch.Tensor, int, int]]:
    """(prompt embeddings [T, H], min_len, max_len) of each text, as the engine hands them over."""
    out = []
    for text in TEXTS:
        ids = model.text_frontend.encode(text)
        session = model.llm.prefill(ids, generator=torch.Generator().manual_seed(0))
        out.append((model.llm.lm_input(ids)[0], session.min_len, session.max_len))
    return out


def _expected(model, requests, seeds) -> list[list[int]]:
    """Each request decoded alone on the engine's decode graphs (read step by step)."""
    pool = SlotKV(model.llm.llm.model.model, slots=4, capacity=512)
    graphs = DecodeGraphs(pool, model.llm.llm_decoder, max_rows=2, capture=TapeCapture())
    out = []
    for (embeds, min_len, max_len), seed in zip(requests, seeds, strict=True):
        slot = pool.acquire()
        session = LlmSession(
            cache=slot, pending=embeds[None], min_len=min_len, max_len=max_len, sampling="ras",
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        out.append(decode_stepped(model.llm, graphs, [session])[0])
        slot.release()
    return out


class _Collect:
    def __init__(self, count: int) -> None:
        self.items: dict[str, list[object]] = {}
        self.ended = threading.Semaphore(0)
        self.count = count

    def sink(self, request_id: str):
        self.items[request_id] = []

        def push(item):
            self.items[request_id].append(item)
            if not isinstance(item, int):
                self.ended.release()

        return push

    def wait(self) -> None:
        for _ in range(self.count):
            assert self.ended.acquire(timeout=120)


def test_the_streamer_on_decode_graphs_draws_the_engine_graphs_tokens(model):
    requests, seeds = _requests(model), [11, 12, 13]
    expected = _expected(model, requests, seeds)
    streamer = ThreadedSpeechLlm(model.llm, slots=4, graphs=TapeCapture())
    got = _Collect(len(requests))
    streamer.start()
    try:
        assert streamer.graphs is not None  # made on the streamer's thread before start returned
        for i, ((embeds, min_len, max_len), seed) in enumerate(zip(requests, seeds, strict=True)):
            streamer.submit(f"r{i}", embeds, min_len, max_len, got.sink(f"r{i}"), seed=seed)
        got.wait()
    finally:
        streamer.stop()
    for i, tokens in enumerate(expected):
        assert got.items[f"r{i}"] == [*tokens, None]
    assert streamer.graphs is None or streamer.graphs.replays > 0
    assert streamer.steps < sum(len(t) for t in expected)  # batched: the requests shared steps
    assert streamer.pool.in_use == 0  # every row and the graphs' scratch row given back at stop
    assert streamer.rows_in_use == 0


def test_a_cancel_with_a_step_in_flight_frees_its_row_once_read_and_the_others_go_on(model):
    requests, seeds = _requests(model), [21, 22, 23]
    expected = _expected(model, requests, seeds)
    streamer = ThreadedSpeechLlm(model.llm, slots=4, graphs=TapeCapture())
    got = _Collect(len(requests) - 1)
    cancel_after = threading.Event()
    streamer.start()
    try:
        for i, ((embeds, min_len, max_len), seed) in enumerate(zip(requests, seeds, strict=True)):
            sink = got.sink(f"r{i}")
            if i == 0:

                def first(item, sink=sink):
                    sink(item)
                    if len(got.items["r0"]) == 3:
                        streamer.cancel("r0")  # from the streamer's own thread: a step is in flight
                        cancel_after.set()

                streamer.submit("r0", embeds, min_len, max_len, first, seed=seed)
            else:
                streamer.submit(f"r{i}", embeds, min_len, max_len, sink, seed=seed)
        got.wait()
        assert cancel_after.wait(60)
        assert streamer.active == 0 and streamer.rows_in_use == 0
    finally:
        streamer.stop()
    assert got.items["r0"][:3] == expected[0][:3] and None not in got.items["r0"]
    assert len(got.items["r0"]) < len(expected[0])  # it stopped early
    for i in (1, 2):
        assert got.items[f"r{i}"] == [*expected[i], None]


def test_an_engine_fed_by_the_graphs_streamer_speaks_the_engine_graphs_tokens(model, golden_dir, monkeypatch):
    texts = {"a": TEXTS[0], "b": TEXTS[1]}
    seen = record_speech_tokens(monkeypatch)
    runs = []
    for streamer in (None, ThreadedSpeechLlm(model.llm, slots=4, graphs=TapeCapture())):
        decodes_here = streamer is None  # the engine's own decode graphs
        options = BackendOptions(seed=1234, max_segment_tokens=60, static_decode=decodes_here, graph_rows=4)
        backend = CosyVoice2Backend(model, options=options, streamer=streamer)
        backend.add_voice(golden_voice(model, golden_dir), persist=False)
        if streamer is not None:
            streamer.start()
        engine = EngineWorker(backend, default_voice=GOLDEN_VOICE)
        log = EventLog()
        engine.start()
        try:
            for uid, text in texts.items():
                engine.open_utterance(GOLDEN_VOICE, RecordingSink(), log, utterance_id=uid)
                engine.push_text(uid, text, end=True)
            log.wait_terminal(list(texts), timeout_s=300)
        finally:
            engine.stop()
        backend.close()
        for uid in texts:
            assert [type(e) for e in log.of(uid)] == [FirstAudio, Done]
        runs.append(sorted(seen.values()))
        seen.clear()
    assert runs[0] == runs[1] and all(len(tokens) > 10 for tokens in runs[0])
