"""Batched streaming HiFT: several utterances' next mel chunks vocoded in one forward.

Runs on the engine thread. Each row keeps its own `HiftStreamState` (mel cache, excitation cache,
held-back tail) and draws its excitation from its own generator, exactly as `hift_stream_step` does
alone; only the f0 predictor and the generator network run once for the whole batch. HiFT is non-causal
(its convolutions see right context), so rows are batched only when their vocoder input (cache frames +
new frames) has the same length: no padding, so a batch computes what each row would alone (up to float
rounding of the batched convolutions).

`vocode_batch` is the batched `Token2WavStream.complete`: it runs HiFT for every stream, then queues
every row's device->host copy before waiting for any (`HostCopyAsync`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from voicertc.backends.cosyvoice.hift.generator import HiFTGenerator
from voicertc.backends.cosyvoice.hift.source import SourceDraws
from voicertc.backends.cosyvoice.hift.stream import (
    HiftStreamState,
    finish_chunk,
    hift_stream_step,
    prepend_mel_cache,
)
from voicertc.backends.cosyvoice.serve.token2wav import Chunk, ChunkPlan, Token2WavStream

logger = logging.getLogger(__name__)

HostCopyAsync = Callable[[Tensor], Callable[[], np.ndarray]]  # queue a copy; the callable waits for it
R = TypeVar("R")


def vocoder_frames(state: HiftStreamState, new_frames: int) -> int:
    """The length of the mel HiFT sees for a chunk of `new_frames` (the cache frames included)."""
    return new_frames + (state.mel_cache.shape[2] if state.mel_cache is not None else 0)


@torch.inference_mode()
def hift_stream_step_batch(
    hift: HiFTGenerator,
    mel_chunks: Sequence[Tensor],
    states: Sequence[HiftStreamState],
    finalize: Sequence[bool],
    generators: Sequence[torch.Generator | None],
) -> list[Tensor]:
    """`hift_stream_step` for several rows at once (equal vocoder input lengths); PCM per row."""
    # mel_chunks: B x [1, 80, T_new] -> B x pcm [N]
    if len(states) == 1:
        return [hift_stream_step(hift, mel_chunks[0], states[0], finalize[0], generator=generators[0])]
    mels, mel, source = _excitation(hift, mel_chunks, states, generators)
    return _finish_rows(hift.decode(mel, source), source, mels, states, finalize)


def hift_stream_step_parts(
    hift: HiFTGenerator,
    mel_chunks: Sequence[Tensor],
    states: Sequence[HiftStreamState],
    finalize: Sequence[bool],
    generators: Sequence[torch.Generator | None],
) -> Generator[None, None, list[Tensor]]:
    """`hift_stream_step_batch` (one row or more) in parts: the excitation, then each upsampling stage
    (`HiFTGenerator.decode_parts`); the states change only in the last part, when the PCM is returned.
    Run each `next()` under `torch.inference_mode()`."""
    mels, mel, source = _excitation(hift, mel_chunks, states, generators)
    yield
    speech = yield from hift.decode_parts(mel, source)
    return _finish_rows(speech, source, mels, states, finalize)


def _finish_rows(
    speech: Tensor,
    source: Tensor,
    mels: list[Tensor],
    states: Sequence[HiftStreamState],
    finalize: Sequence[bool],
) -> list[Tensor]:
    return [
        finish_chunk(speech[row : row + 1], source[row : row + 1], mels[row], state, final)
        for row, (state, final) in enumerate(zip(states, finalize, strict=True))
    ]


def _excitation(
    hift: HiFTGenerator,
    mel_chunks: Sequence[Tensor],
    states: Sequence[HiftStreamState],
    generators: Sequence[torch.Generator | None],
) -> tuple[list[Tensor], Tensor, Tensor]:
    """The rows' vocoder inputs (mel cache prepended), their batch, and its excitation: each row drawn
    from its own generator, its first samples the row's cached source (`HiFTGenerator.infer` per row)."""
    mels = [prepend_mel_cache(mel_chunk, state) for mel_chunk, state in zip(mel_chunks, states, strict=True)]
    if len({m.shape[2] for m in mels}) != 1:
        raise ValueError("a HiFT batch needs vocoder inputs of one length")
    mel = torch.cat(mels, dim=0)
    f0_hz = hift.f0(mel)
    samples = f0_hz.shape[1] * hift.config.samples_per_frame
    harmonics = hift.config.nb_harmonics + 1
    draws = [SourceDraws.draw(1, samples, harmonics, g) for g in generators]
    source = hift.source_from_f0(
        f0_hz,
        SourceDraws(
            initial_phase=torch.cat([d.initial_phase for d in draws], dim=0),
            noise=torch.cat([d.noise for d in draws], dim=0),
        ),
    )
    for row, state in enumerate(states):
        if state.source_cache is not None and state.source_cache.shape[2] > 0:
            source[row : row + 1, :, : state.source_cache.shape[2]] = state.source_cache
    return mels, mel, source


def _sync_copy(pcm: Tensor) -> Callable[[], np.ndarray]:
    host = pcm.detach().to("cpu", torch.float32).numpy()
    return lambda: host


def vocode_batch(
    streams: Sequence[Token2WavStream],
    plans: Sequence[ChunkPlan],
    mels: Sequence[Tensor],
    flow_s: Sequence[float],
    to_host: HostCopyAsync = _sync_copy,
) -> list[Chunk]:
    """`Token2WavStream.complete` for several streams in one HiFT forward (equal vocoder lengths)."""
    started = time.perf_counter()
    pcm = hift_stream_step_batch(
        streams[0].hift,
        [m.float() for m in mels],  # HiFT stays float32 when the flow runs in half precision
        _states(streams),
        [p.final for p in plans],
        [s.generator for s in streams],
    )
    return _complete(streams, plans, mels, flow_s, pcm, to_host, time.perf_counter() - started)


def vocode_batch_parts(
    streams: Sequence[Token2WavStream],
    plans: Sequence[ChunkPlan],
    mels: Sequence[Tensor],
    flow_s: Sequence[float],
    to_host: HostCopyAsync = _sync_copy,
) -> Generator[None, None, list[Chunk]]:
    """`vocode_batch` in parts (`hift_stream_step_parts`), for an engine unit's budget: the streams
    change only in the last part, which returns the chunks. Run each `next()` under inference mode."""
    states = _states(streams)
    parts = hift_stream_step_parts(
        streams[0].hift,
        [m.float() for m in mels],
        states,
        [p.final for p in plans],
        [s.generator for s in streams],
    )
    pcm, spent_s = yield from timed_parts(parts)
    return _complete(streams, plans, mels, flow_s, pcm, to_host, spent_s)


def timed_parts(parts: Generator[None, None, R]) -> Generator[None, None, tuple[R, float]]:
    """`parts` passed through, its result returned with the seconds spent inside it (not between parts)."""
    spent_s = 0.0
    while True:
        started = time.perf_counter()
        try:
            next(parts)
        except StopIteration as end:
            return end.value, spent_s + time.perf_counter() - started
        spent_s += time.perf_counter() - started
        yield


def queue_host_copies(
    pcm: Sequence[Tensor], to_host: HostCopyAsync, spent_s: float
) -> tuple[list[Callable[[], np.ndarray]], float]:
    """Every row's device->host copy queued before the first wait; each row's share of the vocoder time."""
    started = time.perf_counter()
    waits = [to_host(p) for p in pcm]
    return waits, (spent_s + time.perf_counter() - started) / len(pcm)


def _states(streams: Sequence[Token2WavStream]) -> list[HiftStreamState]:
    states = []
    for stream in streams:
        if stream.hift_state is None:
            raise ValueError("this token2wav stream is released")
        if stream.source_fn is not None:
            raise ValueError("an injected excitation (source_fn) is vocoded alone")
        states.append(stream.hift_state)
    return states


def _complete(
    streams: Sequence[Token2WavStream],
    plans: Sequence[ChunkPlan],
    mels: Sequence[Tensor],
    flow_s: Sequence[float],
    pcm: list[Tensor],
    to_host: HostCopyAsync,
    spent_s: float,
) -> list[Chunk]:
    waits, vocoder_s = queue_host_copies(pcm, to_host, spent_s)
    chunks = []
    for stream, plan, mel, wait, seconds in zip(streams, plans, mels, waits, flow_s, strict=True):
        chunk = Chunk(stream.chunk_index, mel, wait(), plan.final, flow_s=seconds, vocoder_s=vocoder_s)
        stream.emitted_tokens = plan.end_tokens
        stream.chunk_index += 1
        if plan.final:
            stream.finished = True
            stream.release()
        chunks.append(chunk)
    return chunks
