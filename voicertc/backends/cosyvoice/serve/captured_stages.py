"""`[engine] cuda_graphs` for the flow and vocoder stages: install their captured static-shape steps on a
loaded model, under one memory budget, and report what they did (start-up log, /metrics).

Runs on the engine thread (the backend's constructor, which runs there). The LLM decode has its own
graphs (`llm.graphs.DecodeGraphs`). CosyVoice3's DiT estimator takes the same captured path as
CosyVoice2's UNet (one mechanism, two estimators); its causal HiFT's synthesis takes the same
`StaticSteps`, one bucket per stream phase (`hift.captured_causal`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from voicertc.backends.cosyvoice.accel.captured import Capture, GraphBudget, StageStats
from voicertc.backends.cosyvoice.flow.captured import Buckets, CapturedEstimator
from voicertc.backends.cosyvoice.flow.captured_encoder import CapturedEncoder, encoder_buckets
from voicertc.backends.cosyvoice.flow.dit import DiT
from voicertc.backends.cosyvoice.flow.graph import StreamingEstimator
from voicertc.backends.cosyvoice.flow.qkv import fuse_qkv
from voicertc.backends.cosyvoice.flow.unet import CausalConditionalDecoder
from voicertc.backends.cosyvoice.hift.captured import CapturedHiftDecode
from voicertc.backends.cosyvoice.hift.captured_causal import CapturedCausalHift
from voicertc.backends.cosyvoice.hift.causal import CausalHiFTGenerator
from voicertc.backends.cosyvoice.hift.generator import HiFTGenerator
from voicertc.backends.cosyvoice.hift.stream import MEL_CACHE_FRAMES
from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
from voicertc.engine.schedule import ChunkSchedule

logger = logging.getLogger(__name__)

DEFAULT_CPU_BUDGET_MB = 2048.0
WARM_CHUNKS = 6  # v3's causal HiFT: the first chunks' phases captured at start (later ones repeat them)


@dataclass
class CapturedStages:
    """The captured stages of one model and their shared budget."""

    budget: GraphBudget
    flow: CapturedEstimator | None
    hift: CapturedHiftDecode | CapturedCausalHift | None
    encoder: CapturedEncoder | None = None  # v2's token encoder (v3's is one conv: eager)

    def stats(self) -> dict[str, StageStats]:
        stages = {"flow": self.flow, "flow_encoder": self.encoder, "vocoder": self.hift}
        return {name: stage.stats for name, stage in stages.items() if stage is not None}

    def warm(self, schedule: ChunkSchedule, warm_keys: int, device: torch.device, dtype: torch.dtype) -> None:
        """Capture, before the engine says ready, the buckets a call meets: the flow's every rows x frames
        bucket with histories up to `warm_keys` frames, HiFT's chunk shapes of `schedule` at every row
        count. Longer histories and other shapes are captured on first use (or run eagerly, counted)."""
        started = time.perf_counter()
        flow_n = hift_n = encoder_n = 0
        like = torch.zeros(1, device=device, dtype=dtype)
        if self.flow is not None:
            b = self.flow.buckets
            flow_n = self.flow.warm(b.rows_list(), list(b.frame_buckets), b.keys_list(warm_keys), like)
        if self.encoder is not None:  # cached tokens: half the frames (a first chunk's voice prompt)
            e = self.encoder.buckets
            keys = e.keys_list(max(warm_keys // 2, e.key_quantum))
            encoder_n = self.encoder.warm(e.rows_list(), list(e.frame_buckets), keys, like)
        rows = [r for r in (1, 2, 4, 8, 16, 32, 64) if r < self.hift.max_rows] if self.hift else []
        if isinstance(self.hift, CapturedCausalHift):  # v3: the phases of an utterance's first chunks
            chunks = [2 * schedule.hop_tokens(i) for i in range(WARM_CHUNKS)]
            hift_n = self.hift.warm(chunks, rows + [self.hift.max_rows], torch.zeros(1, device=device))
        elif self.hift is not None:
            hops = sorted({schedule.hop_tokens(i) for i in range(8)})
            frames = [2 * schedule.first_hop_tokens] + [MEL_CACHE_FRAMES + 2 * hop for hop in hops]
            rows += [self.hift.max_rows]
            like = torch.zeros(1, device=device, dtype=torch.float32)
            hift_n = self.hift.warm(rows, sorted(set(frames)), like)
        logger.info(
            "captured at start: %d flow buckets, %d flow encoder buckets, %d vocoder buckets in %.1f s "
            "(%.0f MB of %.0f MB budget)",
            flow_n, encoder_n, hift_n, time.perf_counter() - started, self.budget.used_bytes / 2**20,
            self.budget.limit_bytes / 2**20,
        )  # fmt: skip

    def seal(self) -> None:
        """Warm-up is over: no captured stage compiles again (`accel.compiled`)."""
        if self.flow is not None:
            self.flow.steps.seal()

    def log_summary(self) -> None:
        for name, stats in self.stats().items():
            logger.info(
                "captured %s: %d buckets (%d uncompiled after warm-up), %.1f MB, %.0f ms capturing; "
                "%d replays, %d eager", name, stats.captures, stats.uncompiled, stats.bytes / 2**20,
                1000 * stats.capture_s, stats.replays, stats.eager,
            )  # fmt: skip


def budget_mb(memory_mb: float, device: torch.device) -> float:
    """`[engine] graph_memory_mb`, or (0) a quarter of the card's memory."""
    if memory_mb > 0:
        return memory_mb
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 4 / 2**20
    return DEFAULT_CPU_BUDGET_MB


def install_captured_steps(
    model: CosyVoice2Model, max_utterances: int, memory_mb: float, capture: Capture, compile: bool = False
) -> CapturedStages:
    """Put the captured flow estimator and HiFT decode in place on `model` (where its parts allow);
    `compile`: the flow step compiled by inductor before its captures."""
    budget = GraphBudget(limit_bytes=int(budget_mb(memory_mb, model.device) * 2**20))
    flow = None
    decoder = model.flow.decoder
    estimator = decoder.estimator
    if decoder.estimator_runner is None and isinstance(estimator, (CausalConditionalDecoder, DiT)):
        fuse_qkv(estimator)  # each attention block's q/k/v as one matmul (fewer launches per step)
        flow = CapturedEstimator(
            StreamingEstimator(estimator), buckets=Buckets(max_rows=2 * max_utterances), capture=capture,
            budget=budget, compile=compile,
        )  # fmt: skip
        decoder.estimator_runner = flow
    encoder = None
    flow_module = model.flow
    if flow_module.encodes_rows and flow_module.encoder_runner is None:  # v2's conformer token encoder
        encoder = CapturedEncoder(
            flow_module.encoder, buckets=encoder_buckets(max_utterances), capture=capture, budget=budget
        )
        flow_module.encoder_runner = encoder
    hift: CapturedHiftDecode | CapturedCausalHift | None = None
    if isinstance(model.hift, HiFTGenerator):
        hift = CapturedHiftDecode(model.hift, max_rows=max_utterances, capture=capture, budget=budget)
        model.hift.decode_runner = hift
    elif isinstance(model.hift, CausalHiFTGenerator) and model.hift.synthesis_runner is None:
        hift = CapturedCausalHift(model.hift, max_rows=max_utterances, capture=capture, budget=budget)
        model.hift.synthesis_runner = hift
    flow_mode = ("compiled" if compile else "on") if flow else "off"
    logger.info(
        "captured steps: flow %s, flow encoder %s, vocoder %s, budget %.0f MB",
        flow_mode, "on" if encoder else "off", "on" if hift else "off", budget.limit_bytes / 2**20,
    )  # fmt: skip
    return CapturedStages(budget, flow, hift, encoder)


def remove_captured_steps(model: CosyVoice2Model, stages: CapturedStages) -> None:
    if stages.flow is not None and model.flow.decoder.estimator_runner is stages.flow:
        model.flow.decoder.estimator_runner = None
    if stages.encoder is not None and model.flow.encoder_runner is stages.encoder:
        model.flow.encoder_runner = None
    if stages.hift is not None and isinstance(model.hift, HiFTGenerator):
        model.hift.decode_runner = None
    if stages.hift is not None and isinstance(model.hift, CausalHiFTGenerator):
        model.hift.synthesis_runner = None
