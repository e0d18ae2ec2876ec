"""The captured static-shape steps on CUDA (marked gpu: skipped on machines without one).

Replays of the flow estimator and of HiFT's network equal their eager steps within the run-to-run floor
(TF32 and kernel choice differ between a replay and an eager launch, so the bound is measured, not 0);
the engine speaks with every stage captured (decode, flow, vocoder: replays counted, no capture failed);
32 utterances started at once all complete.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from cv2_engine_helpers import SFT_VOICE, build_speaking_model_dir
from engine_helpers import EventLog, RecordingSink
from flow_stream_helpers import stream_golden

from voicertc.assemble import create_engine
from voicertc.backends.cosyvoice.accel.captured import CudaCapture
from voicertc.backends.cosyvoice.flow.captured import Buckets, CapturedEstimator
from voicertc.backends.cosyvoice.flow.captured_encoder import CapturedEncoder
from voicertc.backends.cosyvoice.flow.flow import CausalFlow
from voicertc.backends.cosyvoice.flow.graph import StreamingEstimator
from voicertc.backends.cosyvoice.hift.captured import CapturedHiftDecode
from voicertc.backends.cosyvoice.hift.generator import HiftConfig, HiFTGenerator
from voicertc.backends.cosyvoice.hift.stream import hift_stream_step, init_hift_stream_state
from voicertc.backends.cosyvoice.hift.weights import load_hift_file
from voicertc.backends.cosyvoice.load.yaml_config import load_yaml
from voicertc.config import Config, EngineConfig
from voicertc.engine import Done, FirstAudio

pytestmark = pytest.mark.gpu

HOPS = [25, 50]


def test_a_failed_capture_gives_the_allocator_back_and_the_next_one_replays():
    """A step that syncs the host cannot be captured: the error is the step's own, the allocator stops
    routing into the failed capture's pool, and the next capture (a new pool) replays correctly."""
    capture = CudaCapture()
    x = torch.ones(4, device="cuda")

    def syncs():
        return (x * float(x.sum().item()),)

    with pytest.raises(RuntimeError):
        capture(syncs)
    replay = capture(lambda: (x * 2.0,))
    x.fill_(3.0)
    assert replay()[0].tolist() == [6.0] * 4
    freed = torch.empty(1 << 20, device="cuda")  # ordinary allocations free and are reused as before
    del freed
    again = torch.empty(1 << 20, device="cuda")
    assert again.numel() == 1 << 20


def test_flow_replays_equal_the_eager_stream_on_cuda(tiny_model_dir, tts_golden):
    flow = CausalFlow.from_model_dir(tiny_model_dir).cuda()
    golden = tts_golden  # CPU tensors: the flow moves its inputs to its device
    eager = stream_golden(flow, golden, HOPS)
    floor = (stream_golden(flow, golden, HOPS) - eager).abs().max().item()
    runner = CapturedEstimator(
        StreamingEstimator(flow.decoder.estimator), buckets=Buckets(max_rows=8), capture=CudaCapture()
    )
    flow.decoder.estimator_runner = runner
    try:
        got = stream_golden(flow, golden, HOPS)
        again = stream_golden(flow, golden, HOPS)
    finally:
        flow.decoder.estimator_runner = None
    assert runner.stats.failed is None and runner.stats.replays > 0 and runner.stats.captures > 0
    assert (got - again).abs().max().item() == 0.0  # a replay is deterministic
    assert (got - eager).abs().max().item() <= max(1e-4, 10 * floor)


def test_flow_encoder_replays_equal_the_eager_stream_on_cuda(tiny_model_dir, tts_golden):
    flow = CausalFlow.from_model_dir(tiny_model_dir).cuda()
    eager = stream_golden(flow, tts_golden, HOPS)
    floor = (stream_golden(flow, tts_golden, HOPS) - eager).abs().max().item()
    buckets = Buckets(max_rows=4, key_quantum=32, max_keys=512, frame_buckets=(32, 64, 128), smallest_rows=1)
    flow.encoder_runner = runner = CapturedEncoder(flow.encoder, buckets=buckets, capture=CudaCapture())
    try:
        got = stream_golden(flow, tts_golden, HOPS)
        again = stream_golden(flow, tts_golden, HOPS)
    finally:
        flow.encoder_runner = None
    assert runner.stats.failed is None and runner.stats.replays > 0 and runner.stats.eager == 0
    assert (got - again).abs().max().item() == 0.0  # a replay is deterministic
    assert (got - eager).abs().max().item() <= max(1e-4, 10 * floor)


def test_hift_replays_equal_the_eager_decode_on_cuda(tiny_model_dir, golden_dir):
    config = HiftConfig.from_yaml(load_yaml(golden_dir / "model_dir" / "cosyvoice2.yaml")["hift"])
    hift = HiFTGenerator(config)
    load_hift_file(hift, tiny_model_dir / "hift.pt")
    hift = copy.deepcopy(hift.eval()).cuda()
    gen = torch.Generator().manual_seed(3)
    mels = [(torch.randn(1, 80, n, generator=gen) - 4.0).cuda() for n in (20, 14, 12)]

    def stream() -> list[torch.Tensor]:
        state, draws = init_hift_stream_state(), torch.Generator().manual_seed(7)
        return [hift_stream_step(hift, m, state, i == 2, generator=draws) for i, m in enumerate(mels)]

    eager = stream()
    hift.decode_runner = runner = CapturedHiftDecode(hift, max_rows=4, capture=CudaCapture())
    try:
        got, again = stream(), stream()
    finally:
        hift.decode_runner = None
    assert (
        runner.stats.failed is None and runner.stats.replays == 6 and runner.stats.captures == 2
    )  # 20 and 8 + 14 frames
    for e, g, a in zip(eager, got, again, strict=True):
        assert torch.equal(g, a)
        assert (g - e).abs().max().item() <= 1e-4


def test_causal_hift_replays_equal_the_eager_stream_on_cuda(tiny_cv3_model_dir):
    """CosyVoice3's causal HiFT synthesis (excitation eager): 2 rows, 4 chunks, replays vs eager."""
    from voicertc.backends.cosyvoice.hift.captured_causal import CapturedCausalHift
    from voicertc.backends.cosyvoice.hift.causal import HiftStreamState
    from voicertc.backends.cosyvoice.hift.causal_batch import step_batch
    from voicertc.backends.cosyvoice3 import load as load_v3

    hift = load_v3(tiny_cv3_model_dir).hift.cuda()
    gen = torch.Generator().manual_seed(5)
    sizes = [50, 100, 100, 40]
    mels = [[(torch.randn(1, 80, n, generator=gen) - 4.0).cuda() for n in sizes] for _ in range(2)]

    def stream() -> list[torch.Tensor]:
        states, out = [HiftStreamState(), HiftStreamState()], []
        for k in range(len(sizes)):
            out += step_batch(hift, [m[k] for m in mels], states, final=k == len(sizes) - 1)
        return out

    eager = stream()
    hift.synthesis_runner = runner = CapturedCausalHift(hift, max_rows=4, capture=CudaCapture())
    try:
        got, again = stream(), stream()
    finally:
        hift.synthesis_runner = None
    assert runner.stats.failed is None and runner.stats.replays == 2 * (len(sizes) - 1)
    assert runner.stats.captures == 2 and runner.stats.eager == 2  # 50, 100 (twice: one phase); final eager
    for e, g, a in zip(eager, got, again, strict=True):
        assert torch.equal(g, a)
        assert (g - e).abs().max().item() <= 1e-4


def started_captured_engine(backend: str, model_dir, voices_dir, max_batch: int, compile: bool = False):
    """An engine on CUDA in bfloat16 with every stage captured (`compile`: decode and flow steps
    compiled first), started (warm-up done)."""
    config = Config(
        engine=EngineConfig(
            backend=backend, model_dir=str(model_dir), device="cuda", dtype="bfloat16",
            cuda_graphs=True, compile=compile, voices_dir=str(voices_dir), max_batch=max_batch,
        )
    )  # fmt: skip
    engine = create_engine(config)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def captured_engine(tiny_model_dir, golden_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("captured")
    model_dir = build_speaking_model_dir(tiny_model_dir, golden_dir, tmp / "cv2")
    engine = started_captured_engine("cosyvoice2", model_dir, tmp, max_batch=16)
    yield engine
    engine.stop()


def test_the_engine_speaks_with_every_stage_captured(captured_engine):
    log, sink = EventLog(), RecordingSink()
    uid = captured_engine.say(SFT_VOICE, sink, log, "Hello there, every stage of this is captured.")
    log.wait_terminal([uid], timeout_s=120)
    assert [type(e) for e in log.of(uid)] == [FirstAudio, Done]
    pcm = sink.samples(uid)
    assert pcm.size > 0 and np.isfinite(pcm).all()
    backend = captured_engine.backend
    stats = backend.captured.stats()
    assert backend.graphs.replays > 0
    assert stats["flow"].failed is None and stats["flow"].replays > 0
    assert stats["flow_encoder"].failed is None and stats["flow_encoder"].replays > 0
    assert stats["vocoder"].failed is None and stats["vocoder"].replays > 0


def test_thirty_two_utterances_at_once_complete(captured_engine):
    log, sinks = EventLog(), [RecordingSink() for _ in range(32)]
    uids = [
        captured_engine.say(SFT_VOICE, sink, log, f"Caller number {i} hears this sentence spoken now.")
        for i, sink in enumerate(sinks)
    ]
    log.wait_terminal(uids, timeout_s=300)
    for uid, sink in zip(uids, sinks, strict=True):
        assert [type(e) for e in log.of(uid)] == [FirstAudio, Done], uid
        pcm = sink.samples(uid)
        assert pcm.size > 0 and np.isfinite(pcm).all()


@pytest.mark.parametrize("compile", [False, True], ids=["kernels", "compiled"])
def test_cosyvoice3_captures_its_buckets_before_ready_and_speaks(tmp_path, compile):
    """v3 warms the same captured stages as v2 before the engine says ready (it once skipped them and
    captured every bucket on first use, in the first callers' time to first audio); compiled too."""
    from bench.make_tiny_cv3_model_dir import make_tiny_cv3_model_dir

    model_dir = make_tiny_cv3_model_dir(tmp_path / "cv3")
    engine = started_captured_engine("cosyvoice3", model_dir, tmp_path, 4, compile=compile)
    try:
        backend = engine.backend
        warmed = backend.captured.stats()
        assert warmed["flow"].failed is None and warmed["flow"].captures > 0
        assert warmed["vocoder"].failed is None and warmed["vocoder"].captures > 0
        log, sink = EventLog(), RecordingSink()
        uid = engine.say(SFT_VOICE, sink, log, "Hello there, CosyVoice3 is captured too.")
        log.wait_terminal([uid], timeout_s=120)
        assert [type(e) for e in log.of(uid)] == [FirstAudio, Done]
        pcm = sink.samples(uid)
        assert pcm.size > 0 and np.isfinite(pcm).all()
        assert backend.captured.stats()["flow"].replays > 0
        assert backend.captured.stats()["vocoder"].replays > 0
        assert backend.captured.flow is not None and backend.captured.flow.steps.compiled == compile
    finally:
        engine.stop()
