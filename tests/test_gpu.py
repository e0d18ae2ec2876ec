"""The same engine on CUDA (marked gpu: skipped on machines without one).

fp32 on the GPU must still reproduce the reference streaming chunks; fp16 must speak sane audio
through the real worker with its compute/copy streams.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cv2_engine_helpers import SFT_VOICE, build_speaking_model_dir
from decode_helpers import decode_ahead, decode_stepped
from engine_helpers import EventLog, RecordingSink
from safetensors.torch import load_file
from torch.testing import assert_close

from voicertc.assemble import create_engine
from voicertc.backends.cosyvoice.llm.graphs import DecodeGraphs
from voicertc.backends.cosyvoice.llm.kv import SlotKV
from voicertc.backends.cosyvoice.llm.qwen2lm import LlmSession
from voicertc.backends.cosyvoice.load import load_v2 as load
from voicertc.backends.cosyvoice.load.v2 import load_llm
from voicertc.backends.cosyvoice.serve.streams import token2wav_stream
from voicertc.backends.cosyvoice.voice.voices import voice_from_features
from voicertc.config import Config, EngineConfig
from voicertc.engine import ChunkSchedule, Done, FirstAudio

pytestmark = pytest.mark.gpu


def test_streaming_chunks_on_cuda_match_the_reference(tiny_model_dir, golden_dir):
    tts = load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")
    chunkmask_mel = load_file(golden_dir / "flow_nonstream.safetensors")["chunkmask_mel"]
    model = load(tiny_model_dir, device="cuda", check_frontend=False)
    voice = voice_from_features(model, tts["in_prompt_token"], tts["in_prompt_feat"], tts["in_embedding"])
    stream = token2wav_stream(model, voice, ChunkSchedule())
    chunks = stream.push(tts["in_token"]) + stream.finish()
    for k, chunk in enumerate(chunks[:3]):
        expected = tts[f"stream_call{k}_flow_mel_after_offset_cut"]
        assert_close(chunk.mel.cpu(), expected, atol=1e-3, rtol=1e-3)
    assert_close(torch.cat([c.mel.cpu() for c in chunks], dim=2), chunkmask_mel, atol=1e-3, rtol=1e-3)
    assert all(np.isfinite(c.pcm).all() for c in chunks)


@pytest.mark.parametrize("compile", [False, True], ids=["kernels", "compiled"])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_decode_graph_replays_match_the_eager_step(tiny_model_dir, rows, compile):
    """The captured CUDA graph of a bucket (its kernels compiled by inductor first, `compile`) gives
    the eager batched step's logits, step after step."""
    llm = load_llm(tiny_model_dir, "cuda")
    backbone, head = llm.llm.model.model, llm.llm_decoder
    hidden = backbone.config.hidden_size
    eager_pool, graph_pool = SlotKV(backbone, slots=8, capacity=64), SlotKV(backbone, slots=8, capacity=64)
    graphs = DecodeGraphs(graph_pool, head, max_rows=8, compile=compile)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randn(1, 5 + 4 * i, hidden, generator=gen).cuda() for i in range(rows)]
    eager_rows, graph_rows = [], []
    for prompt in prompts:
        eager_rows.append(eager_pool.acquire())
        graph_rows.append(graph_pool.acquire())
        eager_rows[-1].feed(prompt)
        graph_rows[-1].feed(prompt)
    for _ in range(80):  # passes the capacity of 64: the pool grows and the graphs are captured again
        embeds = torch.randn(rows, 1, hidden, generator=gen).cuda()
        expected = head(eager_pool.forward(eager_rows, embeds)[:, -1])
        assert_close(graphs.logits(graph_rows, embeds), expected, atol=1e-4, rtol=1e-4)
    assert graphs.captures >= 2 and graphs.replays == 80 and graph_pool.capacity == 128


def test_decoding_ahead_on_cuda_draws_the_step_by_step_tokens(tiny_model_dir):
    """Captured steps launched before the one before is read (events, pinned copies, the token in
    flight in RAS's window on the device) draw what reading every step at once draws."""
    llm = load_llm(tiny_model_dir, "cuda")
    texts = [[5, 9, 2, 4], [7, 1, 3, 8, 4, 6], [3, 3, 1]]

    def sessions(pool: SlotKV) -> list[LlmSession]:
        return [
            llm.prefill(t, generator=torch.Generator("cuda").manual_seed(i), kv=pool.acquire())
            for i, t in enumerate(texts)
        ]

    def graphs() -> tuple[DecodeGraphs, list[LlmSession]]:
        pool = SlotKV(llm.llm.model.model, slots=8, capacity=256)
        return DecodeGraphs(pool, llm.llm_decoder, max_rows=4), sessions(pool)

    stepped = decode_stepped(llm, *graphs())
    ahead_graphs, ahead_sessions = graphs()
    ahead, behind, _ = decode_ahead(llm, ahead_graphs, ahead_sessions)
    assert ahead == stepped and all(len(tokens) > 0 for tokens in ahead)
    assert ahead_graphs.replays > 0 and behind > 0


def test_the_llm_streamer_on_its_own_stream_draws_the_engine_graphs_tokens(tiny_model_dir):
    """`llm = "thread"` with graphs: captured on the streamer's thread, replayed on its own CUDA stream,
    decoding ahead, the prompt embeddings made on this thread's stream: each request's tokens are those
    of the engine's decode graphs read step by step."""
    import threading

    from voicertc.backends.cosyvoice.llm.streamer import ThreadedSpeechLlm

    llm = load_llm(tiny_model_dir, "cuda")
    texts = [[5, 9, 2, 4], [7, 1, 3, 8, 4, 6], [3, 3, 1]]
    pool = SlotKV(llm.llm.model.model, slots=8, capacity=256)
    graphs = DecodeGraphs(pool, llm.llm_decoder, max_rows=4)
    expected, lengths = [], []
    for i, text in enumerate(texts):
        ruled = llm.prefill(text, generator=torch.Generator("cuda").manual_seed(i))  # min_len, max_len
        lengths.append((ruled.min_len, ruled.max_len))
        session = LlmSession(
            cache=pool.acquire(), pending=llm.lm_input(text), min_len=ruled.min_len,
            max_len=ruled.max_len, sampling="ras", generator=torch.Generator("cuda").manual_seed(i),
        )  # fmt: skip
        expected.append(decode_stepped(llm, graphs, [session])[0])
    streamer = ThreadedSpeechLlm(llm, slots=4, graphs=True)
    got: dict[int, list[object]] = {i: [] for i in range(len(texts))}
    ended = threading.Semaphore(0)

    def sink(i: int):
        def push(item: object) -> None:
            got[i].append(item)
            if not isinstance(item, int):
                ended.release()

        return push

    streamer.start()
    try:
        assert streamer.graphs is not None and streamer.graphs.captures > 0
        for i, (text, (min_len, max_len)) in enumerate(zip(texts, lengths, strict=True)):
            embeds = llm.lm_input(text)[0] * 1.0  # made on this thread's stream, just now
            streamer.submit(f"r{i}", embeds, min_len, max_len, sink(i), seed=i)
        for _ in texts:
            assert ended.acquire(timeout=120)
    finally:
        streamer.stop()
    assert [got[i] for i in range(len(texts))] == [[*tokens, None] for tokens in expected]


def test_prompt_step_replays_match_feeding_each_prompt(tiny_model_dir):
    """Prompts of three rows (different prefixes and lengths) as one captured prompt step give each
    row's eager last-position logits, and decoding on from them stays exact."""
    llm = load_llm(tiny_model_dir, "cuda")
    backbone, head = llm.llm.model.model, llm.llm_decoder
    hidden = backbone.config.hidden_size
    eager_pool, graph_pool = SlotKV(backbone, slots=8, capacity=64), SlotKV(backbone, slots=8, capacity=64)
    graphs = DecodeGraphs(graph_pool, head, max_rows=4)
    gen = torch.Generator().manual_seed(3)
    eager_rows, graph_rows, prompts = [], [], []
    for n in (4, 7, 10):
        prefix = torch.randn(1, n, hidden, generator=gen).cuda()
        eager_rows.append(eager_pool.acquire())
        graph_rows.append(graph_pool.acquire())
        eager_rows[-1].feed(prefix)
        graph_rows[-1].feed(prefix)
        prompts.append(torch.randn(1, 3 * n, hidden, generator=gen).cuda())
    expected = torch.stack([head(r.feed(p)[0, -1]) for r, p in zip(eager_rows, prompts, strict=True)])
    got = graphs.prompt_logits(graph_rows, prompts)
    assert got is not None and graphs.prompt_captures == 1 and graphs.prompt_replays == 1
    assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for _ in range(5):
        embeds = torch.randn(3, 1, hidden, generator=gen).cuda()
        want = head(eager_pool.forward(eager_rows, embeds)[:, -1])
        assert_close(graphs.logits(graph_rows, embeds), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("dtype", "cuda_graphs", "compile"),
    [
        ("float32", False, False),
        ("float16", False, False),
        ("float32", True, False),
        ("bfloat16", True, False),
        pytest.param("bfloat16", True, True, id="bfloat16-graphs-compiled"),  # decode + flow compiled first
    ],
)
def test_the_engine_speaks_on_cuda(tiny_model_dir, golden_dir, tmp_path, dtype, cuda_graphs, compile):
    model_dir = build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path / "cv2")
    config = Config(
        engine=EngineConfig(
            backend="cosyvoice2",
            model_dir=str(model_dir),
            device="cuda",
            dtype=dtype,
            cuda_graphs=cuda_graphs,
            compile=compile,
            voices_dir=str(tmp_path),
        )
    )
    engine = create_engine(config)
    engine.start()
    try:
        log, sink = EventLog(), RecordingSink()
        uid = engine.say(SFT_VOICE, sink, log, "Hello there, this runs on the GPU.")
        log.wait_terminal([uid], timeout_s=120)
        graphs = engine.backend.graphs
        replays = graphs.replays if graphs is not None else 0
    finally:
        engine.stop()
    assert [type(e) for e in log.of(uid)] == [FirstAudio, Done]
    pcm = sink.samples(uid)
    assert pcm.size > 0 and np.isfinite(pcm).all() and np.abs(pcm).max() <= 1.0
    assert engine.backend.model.device.type == "cuda"
    assert (replays > 0) == cuda_graphs
    assert graphs is None or graphs.compiled == compile
