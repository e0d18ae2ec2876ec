"""Token2WavStream for CosyVoice3: CosyVoice2's scheduling and incremental flow, v3's incremental HiFT.

The chunk plan, the flow step (K/V caches, batched estimator) and the bookkeeping are CosyVoice2's
`Token2WavStream`. The vocoder differs: upstream v3 keeps the whole mel history and re-runs HiFT over
it for every chunk, emitting the new samples; here the causal HiFT runs incrementally
(`CausalHiFTGenerator.step`) and emits exactly those samples: after a non-final chunk the stream has
emitted 480 x (mel frames so far - 8) samples, after `finish()` 480 x all frames.

The final chunk follows the schedule's `final_chunk` as for CosyVoice2: "chunk_mask" (default) keeps the
chunk masks and costs the chunk only; "reference" re-runs the flow over every token with full attention
and keeps the new frames, as upstream does (O(n) once, `Token2WavStream.flow_mel`).

`flow_history` says how a non-final chunk's mel is computed: "cached" (default) advances the flow from
its K/V caches; "rerun" re-runs the chunk-masked flow over every token so far and keeps the new frames,
exactly upstream's streamed call (O(n) per chunk: a verification mode). Why it exists: upstream's CPU
attention rounds a frame's output differently depending on how many masked keys follow it, so each
re-run recomputes the history (and its K/V) with slightly other values (its own frames 0-57 move by
1.4e-6 between its first and second call); the cached history cannot reproduce that, the mel stays
within 2e-6, but the f0 predictor's gain and the phase integral turn it into PCM differences that grow
along the utterance (~1e-3 after 20 s). Given the same mel, HiFT (excitation included) matches upstream
within 3e-6 over 30 s (`tests/test_cv3_long_parity.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from voicertc.backends.cosyvoice.flow.flow import CausalFlow, FlowStreamState
from voicertc.backends.cosyvoice.hift.batch import HostCopyAsync, queue_host_copies, timed_parts
from voicertc.backends.cosyvoice.hift.causal import CausalHiFTGenerator, HiftStreamState
from voicertc.backends.cosyvoice.hift.causal_batch import phase_key, step_batch, step_batch_parts
from voicertc.backends.cosyvoice.serve.token2wav import Chunk, ChunkPlan, Token2WavStream, host_copy
from voicertc.engine.schedule import ChunkSchedule

logger = logging.getLogger(__name__)

FlowHistory = Literal["cached", "rerun"]
FLOW_HISTORY_MODES: tuple[FlowHistory, ...] = ("cached", "rerun")


@dataclass
class Token2WavStreamV3(Token2WavStream):
    """Per-utterance streaming token2wav for CosyVoice3 (engine thread; `release()` frees every cache)."""

    hift: CausalHiFTGenerator  # type: ignore[assignment]
    hift_state: HiftStreamState | None = field(default_factory=HiftStreamState)  # type: ignore[assignment]
    flow_history: FlowHistory = "cached"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.flow_history not in FLOW_HISTORY_MODES:
            raise ValueError(f"flow_history must be one of {', '.join(FLOW_HISTORY_MODES)}")
        if self.flow_history == "rerun" and self.reference_prompt is None:
            raise ValueError("flow_history 'rerun' needs the voice's flow prompt (reference_prompt)")

    def flow_mel_part(
        self, plan: ChunkPlan, euler_steps: int | None, *, parts: int | None = None
    ) -> Tensor | None:
        """The cached flow step, or with `flow_history = "rerun"` upstream's streamed call: the
        chunk-masked flow over every token so far (+ lookahead), its new frames (a "reference" final
        chunk: full attention over everything, as upstream), in one call (a verification mode)."""
        if self.flow_history == "cached":
            return super().flow_mel_part(plan, euler_steps, parts=parts)
        assert self.reference_prompt is not None and self.flow_state is not None
        upto = len(self.tokens) if plan.final else plan.end_tokens + self.schedule.lookahead_tokens
        tokens = torch.tensor([self.tokens[:upto]], dtype=torch.long)
        full_attention = plan.final and self.full_attention_final
        mel = self.flow.infer(
            tokens, *self.reference_prompt, streaming=not full_attention, finalize=plan.final
        )
        self.flow_state.finished = plan.final
        return mel[:, :, 2 * self.emitted_tokens :]

    def complete(self, plan: ChunkPlan, mel: Tensor, flow_s: float = 0.0) -> Chunk:
        """Vocode the chunk's mel incrementally and advance the stream."""
        # mel: [1, 80, F] -> Chunk with pcm: the samples final now
        if self.hift_state is None:
            raise ValueError("this token2wav stream is released")
        started = time.perf_counter()
        source = self.source_fn(self.chunk_index) if self.source_fn is not None else None
        pcm, _ = self.hift.step(mel.float(), self.hift_state, final=plan.final, source=source)
        return self.advance(plan, mel, self.pcm_to_host(pcm[0]), flow_s, time.perf_counter() - started)

    def advance(
        self, plan: ChunkPlan, mel: Tensor, pcm: np.ndarray, flow_s: float, vocoder_s: float
    ) -> Chunk:
        """The chunk's bookkeeping once its PCM is vocoded (alone or in a batch)."""
        chunk = Chunk(self.chunk_index, mel, pcm, plan.final, flow_s=flow_s, vocoder_s=vocoder_s)
        self.emitted_tokens = plan.end_tokens
        self.chunk_index += 1
        if plan.final:
            self.finished = True
            self.release()
        logger.debug("v3 token2wav chunk %d: %d frames, final=%s", chunk.index, mel.shape[2], plan.final)
        return chunk

    def hift_phase(self, plan: ChunkPlan, mel: Tensor) -> Hashable:
        """Streams whose next chunks have equal phases vocode as one batch (`vocode_batch_v3`)."""
        if self.hift_state is None:
            raise ValueError("this token2wav stream is released")
        if self.source_fn is not None:
            return ("alone", id(self))  # an injected excitation is vocoded alone
        return phase_key(self.hift, self.hift_state, mel.shape[2], plan.final)


def _sync_copy(pcm: Tensor) -> Callable[[], np.ndarray]:
    host = host_copy(pcm)
    return lambda: host


def vocode_batch_v3(
    streams: Sequence[Token2WavStreamV3],
    plans: Sequence[ChunkPlan],
    mels: Sequence[Tensor],
    flow_s: Sequence[float],
    to_host: HostCopyAsync = _sync_copy,
) -> list[Chunk]:
    """`Token2WavStreamV3.complete` for streams in one phase (`hift_phase`), one HiFT forward for all; every
    row's device->host copy is queued before the first wait. The states are untouched if it fails."""
    if len({s.hift_phase(p, m) for s, p, m in zip(streams, plans, mels, strict=True)}) != 1:
        raise ValueError("vocode_batch_v3 needs streams in one HiFT phase (group them by hift_phase())")
    started = time.perf_counter()
    states = [s.hift_state for s in streams]
    pcm = step_batch(streams[0].hift, mels, states, final=plans[0].final)  # type: ignore[arg-type]
    return _advance_all(streams, plans, mels, flow_s, pcm, to_host, time.perf_counter() - started)


def vocode_batch_v3_parts(
    streams: Sequence[Token2WavStreamV3],
    plans: Sequence[ChunkPlan],
    mels: Sequence[Tensor],
    flow_s: Sequence[float],
    to_host: HostCopyAsync = _sync_copy,
) -> Generator[None, None, list[Chunk]]:
    """`vocode_batch_v3` (one stream or more, one phase) in parts (`step_batch_parts`): the streams change
    only in the last part, which returns the chunks. Run each `next()` under inference mode."""
    if any(s.source_fn is not None for s in streams):
        raise ValueError("an injected excitation (source_fn) is vocoded whole, by complete()")
    if len({s.hift_phase(p, m) for s, p, m in zip(streams, plans, mels, strict=True)}) != 1:
        raise ValueError("vocode_batch_v3 needs streams in one HiFT phase (group them by hift_phase())")
    states = [s.hift_state for s in streams]
    parts = step_batch_parts(streams[0].hift, mels, states, final=plans[0].final)  # type: ignore[arg-type]
    pcm, spent_s = yield from timed_parts(parts)
    return _advance_all(streams, plans, mels, flow_s, pcm, to_host, spent_s)


def _advance_all(
    streams: Sequence[Token2WavStreamV3],
    plans: Sequence[ChunkPlan],
    mels: Sequence[Tensor],
    flow_s: Sequence[float],
    pcm: list[Tensor],
    to_host: HostCopyAsync,
    spent_s: float,
) -> list[Chunk]:
    waits, vocoder_s = queue_host_copies(pcm, to_host, spent_s)
    return [
        stream.advance(plan, mel, wait(), seconds, vocoder_s)
        for stream, plan, mel, wait, seconds in zip(streams, plans, mels, waits, flow_s, strict=True)
    ]


def open_stream_v3(
    flow: CausalFlow,
    hift: CausalHiFTGenerator,
    voice_state: FlowStreamState,
    prompt: tuple[Tensor, Tensor, Tensor],
    schedule: ChunkSchedule,
    **options: object,
) -> Token2WavStreamV3:
    """A fresh stream starting at the voice's cached prompt state (cloned, never shared); `prompt` (the
    voice's flow prompt tokens, mel, embedding) serves a "reference" final chunk."""
    if schedule.final_chunk == "reference" or options.get("flow_history") == "rerun":
        options.setdefault("reference_prompt", prompt)
    return Token2WavStreamV3(
        flow=flow,
        hift=hift,
        schedule=schedule,
        flow_state=voice_state.clone(),
        prompt_tokens=int(prompt[0].shape[1]),
        **options,  # type: ignore[arg-type]
    )


def whole_utterance_pcm_v3(
    flow: CausalFlow, hift: CausalHiFTGenerator, prompt: tuple[Tensor, Tensor, Tensor], tokens: Tensor
) -> tuple[Tensor, Tensor]:
    """Upstream's non-streaming token2wav: the full-attention flow over every token, HiFT over the
    whole mel. `prompt` = the voice's flow prompt (tokens, mel, embedding); tokens [1, n]
    -> (pcm [1, 960 n], mel [1, 80, 2 n])."""
    mel = flow.infer(tokens, *prompt, streaming=False, finalize=True)
    pcm, _ = hift.infer(mel.float(), finalize=True)
    return pcm, mel
