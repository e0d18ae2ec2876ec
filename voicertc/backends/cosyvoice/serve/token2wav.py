"""Token2WavStream: one utterance's speech tokens -> mel chunks -> 24 kHz PCM, chunk by chunk.

Runs on the engine thread. The pure `ChunkSchedule` says when a chunk may run (first hop padded to the
25-token grid counted from the prompt start, then growing hops, plus the flow's 3 lookahead tokens);
the flow advances from its per-utterance caches (work proportional to the chunk) and HiFT joins the
chunks with the reference's mel/source caches and Hamming overlap-add. Unlike the reference, the final
chunk keeps the chunk masks, so the concatenated mel equals the chunk-masked whole-utterance mel.

Every mutable thing lives in the stream (flow state cloned from the voice, HiFT state, token buffer,
chunk index); the model and the schedule are shared and never written. `plan()` / `complete()` split a
chunk in two so the engine can run several utterances' flow steps as one estimator batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from voicertc.backends.cosyvoice.flow.flow import CausalFlow, FlowStreamState, WindowSolve
from voicertc.backends.cosyvoice.hift.generator import HiFTGenerator
from voicertc.backends.cosyvoice.hift.stream import HiftStreamState, hift_stream_step, init_hift_stream_state
from voicertc.engine.schedule import ChunkSchedule

logger = logging.getLogger(__name__)

SAMPLE_RATE_HZ = 24000
SourceFn = Callable[[int], Tensor | None]  # chunk index -> injected HiFT excitation (tests), or None
HostCopy = Callable[[Tensor], np.ndarray]  # device PCM [N] -> host float32 (the engine may use a copy stream)


def host_copy(pcm: Tensor) -> np.ndarray:
    """Plain synchronous device -> host copy."""
    return pcm.detach().to("cpu", torch.float32).numpy()


@dataclass
class Chunk:
    """One synthesised chunk: its mel and the PCM that is final now (HiFT holds back 160 ms)."""

    index: int
    mel: Tensor  # [1, 80, F] at 50 Hz
    pcm: np.ndarray  # float32 mono, 24 kHz
    final: bool
    flow_s: float = 0.0
    vocoder_s: float = 0.0


@dataclass(frozen=True)
class ChunkPlan:
    """The flow input of the next chunk; `advance_tokens` must match for chunks batched together."""

    new_tokens: Tensor  # [1, n] generated tokens incl. the lookahead (none when final)
    end_tokens: int  # generated tokens this chunk completes (exclusive end)
    advance_tokens: int  # tokens the flow state advances by (pending prompt + real new tokens)
    final: bool


@dataclass
class Token2WavStream:
    """Per-utterance streaming token2wav. Owned by the engine thread; `release()` frees every cache."""

    flow: CausalFlow
    hift: HiFTGenerator
    schedule: ChunkSchedule
    flow_state: FlowStreamState | None
    prompt_tokens: int
    generator: torch.Generator | None = None
    source_fn: SourceFn | None = None
    pcm_to_host: HostCopy = host_copy
    reference_prompt: tuple[Tensor, Tensor, Tensor] | None = None  # flow prompt (tokens, feat, embedding)
    hift_state: HiftStreamState | None = field(default_factory=init_hift_stream_state)
    tokens: list[int] = field(default_factory=list)  # every generated token pushed so far
    emitted_tokens: int = 0  # tokens whose mel has been emitted
    chunk_index: int = 0
    finished: bool = False
    speed: float = 1.0  # != 1: non-streaming (whole-segment chunks, mel re-timed), as the reference
    speed_window_tokens: int = 500  # a non-streaming chunk's tokens at most (20 s): bounded flow calls
    window: WindowSolve | None = None  # a full-attention flow call between its Euler steps
    window_end_tokens: int = 0  # the tokens `window` completes

    def __post_init__(self) -> None:
        check_schedule(self.schedule, self.flow)

    # ---- tokens in, chunks out -------------------------------------------------------------------

    def push(self, tokens: Sequence[int] | Tensor) -> list[Chunk]:
        """Add generated speech tokens; run every chunk the schedule says is ready."""
        self.add_tokens(tokens)
        chunks = []
        while (plan := self.plan()) is not None:
            chunks.append(self.run(plan))
        return chunks

    def finish(self) -> list[Chunk]:
        """No more tokens: run the ready chunks, then the final one (chunk masks kept) and flush HiFT."""
        chunks = self.push([])
        plan = self.plan(final=True)
        if plan is not None:
            chunks.append(self.run(plan))
        self.finished = True
        return chunks

    def add_tokens(self, tokens: Sequence[int] | Tensor) -> None:
        if self.finished or self.flow_state is None:
            raise ValueError("this token2wav stream is finished or released")
        ids = tokens.reshape(-1).tolist() if isinstance(tokens, Tensor) else list(tokens)
        self.tokens.extend(int(t) for t in ids)

    @property
    def streaming(self) -> bool:
        """False with a speed change: the reference changes speed only in non-streaming synthesis
        (cosyvoice.md §6.2), so a segment is one full-attention chunk — or, past
        `speed_window_tokens`, several (each window its own full-attention call, so a flow call's memory
        and time stay bounded whatever the segment's length, and a cancel lands between windows)."""
        return self.speed == 1.0

    def ready(self) -> bool:
        """The next non-final chunk has all its tokens (incl. lookahead; a whole window without streaming)."""
        if self.finished or self.flow_state is None:
            return False
        if not self.streaming:
            return len(self.tokens) - self.emitted_tokens > self.speed_window_tokens
        return self.schedule.ready(self.chunk_index, self.prompt_tokens, len(self.tokens))

    def next_chunk(self) -> tuple[int, int] | None:
        """(tokens still to generate, flow advance) of the next non-final chunk; None once spent."""
        state = self.flow_state
        if self.finished or state is None:
            return None
        if not self.streaming:
            window = self.speed_window_tokens
            return max(0, self.emitted_tokens + window + 1 - len(self.tokens)), window
        end = self.schedule.chunk_end_tokens(self.chunk_index, self.prompt_tokens)
        need = end + self.schedule.lookahead_tokens - len(self.tokens)
        return max(0, need), state.pending_prompt.shape[1] + end - self.emitted_tokens

    def final_advance(self) -> int | None:
        """The flow advance of the final chunk `plan(final=True)` would run (None: nothing left)."""
        state = self.flow_state
        if self.finished or state is None or self.emitted_tokens == len(self.tokens):
            return None
        return state.pending_prompt.shape[1] + len(self.tokens) - self.emitted_tokens

    def plan(self, final: bool = False) -> ChunkPlan | None:
        """The next chunk to run: a ready non-final one, else (with `final`) the last one; or None."""
        state = self.flow_state
        if self.finished or state is None:
            return None
        start = self.emitted_tokens
        pending = state.pending_prompt.shape[1]
        if self.ready() and not self.streaming:
            end = start + self.speed_window_tokens
            return ChunkPlan(
                torch.tensor([self.tokens[start:end]], dtype=torch.long), end, end - start, False
            )
        if self.ready():
            end = self.schedule.chunk_end_tokens(self.chunk_index, self.prompt_tokens)
            look = self.schedule.lookahead_tokens
            new = torch.tensor([self.tokens[start : end + look]], dtype=torch.long)
            return ChunkPlan(new, end, pending + end - start, final=False)
        if not final or start == len(self.tokens):
            return None  # nothing ever generated (or left): no final chunk to run
        new = torch.tensor([self.tokens[start:]], dtype=torch.long)
        return ChunkPlan(new, len(self.tokens), pending + len(self.tokens) - start, final=True)

    def run(self, plan: ChunkPlan) -> Chunk:
        """Flow + vocoder for one planned chunk (unbatched)."""
        started = time.perf_counter()
        mel = self.flow_mel(plan)
        return self.complete(plan, mel, time.perf_counter() - started)

    @property
    def full_attention_final(self) -> bool:
        """The final chunk is the reference's full-attention call (`final_chunk = "reference"`, or a
        non-streaming utterance, whose only chunk is the reference's non-stream token2wav)."""
        return self.schedule.final_chunk == "reference" or not self.streaming

    def retime(self, plan: ChunkPlan, mel: Tensor) -> Tensor:
        """The reference's speed change: the whole mel linearly interpolated to len / speed frames."""
        # mel: [1, 80, F] -> [1, 80, int(F / speed)]
        if self.streaming:
            return mel
        frames = max(1, int(mel.shape[2] / self.speed))
        return torch.nn.functional.interpolate(mel, size=frames, mode="linear")

    def flow_mel(self, plan: ChunkPlan) -> Tensor:
        """The flow's mel for `plan` alone, in one call (`flow_mel_part` until it is not None)."""
        mel = self.flow_mel_part(plan, euler_steps=None)
        assert mel is not None
        return mel

    def flow_mel_part(
        self, plan: ChunkPlan, euler_steps: int | None, *, parts: int | None = None
    ) -> Tensor | None:
        """The flow's mel for `plan`; a final chunk with `final_chunk = "reference"` (or a window of a
        non-streaming utterance) is a full-attention call (the official non-stream token2wav) solved
        `euler_steps` Euler steps per call (None: all), or `parts` estimator parts per call: None until
        its last step, then its new frames, re-timed by `speed`. A streaming chunk is computed whole here
        (the engine solves it in parts through `CausalFlow.start_stream_batch`)."""
        assert self.flow_state is not None
        full_attention = not self.streaming or (plan.final and self.full_attention_final)
        if not full_attention:
            return self.flow.stream_step(plan.new_tokens, self.flow_state, finalize=plan.final)
        if self.window is None or self.window_end_tokens != plan.end_tokens:
            self.window = self._start_window(plan)
            self.window_end_tokens = plan.end_tokens
        mel = self.flow.advance_window(self.window, euler_steps, parts=parts)
        if mel is None:
            return None
        self.window = None
        self.flow_state.finished = plan.final
        return self.retime(plan, mel if not self.streaming else mel[:, :, 2 * self.emitted_tokens :])

    def _start_window(self, plan: ChunkPlan) -> WindowSolve:
        """The full-attention call of `plan`: its window's tokens without streaming, else the whole
        utterance (the reference's last call, of which the new frames are kept)."""
        if self.reference_prompt is None:
            raise ValueError(
                "a speed change needs the voice's flow prompt (reference_prompt)"
                if not self.streaming
                else "final_chunk 'reference' needs the voice's flow prompt (reference_prompt)"
            )
        prompt_tokens, prompt_feat, embedding = self.reference_prompt
        first = self.emitted_tokens if not self.streaming else 0
        tokens = torch.tensor([self.tokens[first : plan.end_tokens]], dtype=torch.long)
        return self.flow.start_window(
            tokens, prompt_tokens, prompt_feat, embedding, streaming=False, finalize=True
        )

    def complete(self, plan: ChunkPlan, mel: Tensor, flow_s: float = 0.0) -> Chunk:
        """Vocode the flow's mel for `plan` and advance the stream (after a batched flow step too)."""
        # mel: [1, 80, 2 * (end - start)] -> Chunk with pcm [~480 * frames]
        if self.hift_state is None:
            raise ValueError("this token2wav stream is released")
        started = time.perf_counter()
        source = self.source_fn(self.chunk_index) if self.source_fn is not None else None
        vocoder_mel = mel.float()  # HiFT stays float32 when the flow runs in half precision
        pcm = hift_stream_step(
            self.hift, vocoder_mel, self.hift_state, plan.final, generator=self.generator, source=source
        )
        chunk = Chunk(self.chunk_index, mel, self.pcm_to_host(pcm), plan.final, flow_s=flow_s)
        chunk.vocoder_s = time.perf_counter() - started
        self.emitted_tokens = plan.end_tokens
        self.chunk_index += 1
        if plan.final:
            self.finished = True
            self.release()
        logger.debug("token2wav chunk %d: %d frames, final=%s", chunk.index, mel.shape[2], plan.final)
        return chunk

    def release(self) -> None:
        """Drop the flow and vocoder caches (cancel, failure or the end); the stream is spent."""
        self.flow_state = None
        self.hift_state = None
        self.window = None
        self.tokens = []
        self.finished = True


def check_schedule(schedule: ChunkSchedule, flow: CausalFlow) -> None:
    """The flow can only cache chunks that end on its training grid and see exactly its lookahead."""
    grid, look = flow.cfg.chunk_tokens, flow.cfg.pre_lookahead_tokens
    if schedule.grid % grid or schedule.max_hop_tokens % grid:
        raise ValueError(
            f"the schedule's grid and max hop must be multiples of the flow's {grid}-token chunk "
            f"(grid={schedule.grid}, max_hop_tokens={schedule.max_hop_tokens}; set grid_tokens = {grid} "
            f"for a first hop of any length)"
        )
    if schedule.lookahead_tokens != look:
        raise ValueError(f"schedule lookahead_tokens must equal the flow's pre_lookahead_len ({look})")


def open_stream(
    flow: CausalFlow,
    hift: HiFTGenerator,
    voice_state: FlowStreamState,
    prompt_tokens: int,
    schedule: ChunkSchedule,
    **options: object,
) -> Token2WavStream:
    """A fresh stream starting at the voice's cached prompt state (cloned, never shared)."""
    return Token2WavStream(
        flow=flow,
        hift=hift,
        schedule=schedule,
        flow_state=voice_state.clone(),
        prompt_tokens=prompt_tokens,
        **options,  # type: ignore[arg-type]
    )
