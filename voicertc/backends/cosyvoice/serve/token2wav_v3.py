"""Token2WavStream for CosyVoice3: CosyVoice2's scheduling and incremental flow, v3's incremental HiFT.

The chunk plan, the flow step (K/V caches, batched estimator) and the bookkeeping are CosyVoice2's
`Token2WavStream`. The vocoder differs: upstream v3 keeps the whole mel history and re-runs HiFT over
it for every chunk, emitting the new samples; here the causal HiFT runs incrementally
(`CausalHiFTGenerator.step`) and emits exactly those samples: after a non-final chunk the stream has
emitted 480 x (mel frames so far - 8) samples, after `finish()` 480 x all frames.

The final chunk follows the schedule's `final_chunk` as for CosyVoice2: "chunk_mask" (default) keeps the
chunk masks and costs the chunk only; "reference" re-runs the flow over every token with full attention
and keeps the new frames, as upstream does (O(n) once, `Token2WavStream.flow_mel`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from torch import Tensor

from voicertc.backends.cosyvoice.flow.flow import CausalFlow, FlowStreamState
from voicertc.backends.cosyvoice.hift.causal import CausalHiFTGenerator, HiftStreamState
from voicertc.backends.cosyvoice.serve.token2wav import Chunk, ChunkPlan, Token2WavStream
from voicertc.engine.schedule import ChunkSchedule

logger = logging.getLogger(__name__)


@dataclass
class Token2WavStreamV3(Token2WavStream):
    """Per-utterance streaming token2wav for CosyVoice3 (engine thread; `release()` frees every cache)."""

    hift: CausalHiFTGenerator  # type: ignore[assignment]
    hift_state: HiftStreamState | None = field(default_factory=HiftStreamState)  # type: ignore[assignment]

    def complete(self, plan: ChunkPlan, mel: Tensor, flow_s: float = 0.0) -> Chunk:
        """Vocode the chunk's mel incrementally and advance the stream."""
        # mel: [1, 80, F] -> Chunk with pcm: the samples final now
        if self.hift_state is None:
            raise ValueError("this token2wav stream is released")
        started = time.perf_counter()
        source = self.source_fn(self.chunk_index) if self.source_fn is not None else None
        pcm, _ = self.hift.step(mel.float(), self.hift_state, final=plan.final, source=source)
        chunk = Chunk(self.chunk_index, mel, self.pcm_to_host(pcm[0]), plan.final, flow_s=flow_s)
        chunk.vocoder_s = time.perf_counter() - started
        self.emitted_tokens = plan.end_tokens
        self.chunk_index += 1
        if plan.final:
            self.finished = True
            self.release()
        logger.debug("v3 token2wav chunk %d: %d frames, final=%s", chunk.index, mel.shape[2], plan.final)
        return chunk


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
    if schedule.final_chunk == "reference":
        options.setdefault("reference_prompt", prompt)
    return Token2WavStreamV3(
        flow=flow,
        hift=hift,
        schedule=schedule,
        flow_state=voice_state.clone(),
        prompt_tokens=int(prompt[0].shape[1]),
        **options,  # type: ignore[arg-type]
    )
