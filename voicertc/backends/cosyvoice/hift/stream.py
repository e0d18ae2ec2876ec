"""Streaming HiFT with CosyVoice2's chunk joining: mel cache, excitation cache, Hamming overlap-add.

Runs on the engine thread. Each chunk is vocoded with the last 8 mel frames of the previous chunk
prepended and their excitation re-used, so the harmonic phase runs on; the first 3840 samples (160 ms)
are cross-faded with the previous chunk's held-back tail, and the last 3840 samples are held back until
the next chunk (or the final flush). This reproduces the reference `token2wav` exactly, chunk by chunk.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.hift.generator import HiFTGenerator
from voicertc.backends.cosyvoice.hift.overlap_add import fade_in_out, hamming_window

logger = logging.getLogger(__name__)

MEL_CACHE_FRAMES = 8
SOURCE_CACHE_SAMPLES = 8 * 480
SPEECH_TAIL_SAMPLES = 8 * 480


@dataclass
class HiftStreamState:
    """Per-utterance vocoder state; owned by one utterance, mutated only by `hift_stream_step`.

    Invariant: the three caches are either all None (before the first chunk) or all set.
    """

    mel_cache: Tensor | None = None  # [1, 80, 8]
    source_cache: Tensor | None = None  # [1, 1, 3840]
    speech_tail: Tensor | None = None  # [1, 3840], held back, not yet emitted
    finished: bool = False


def init_hift_stream_state() -> HiftStreamState:
    return HiftStreamState()


def hift_stream_step(
    hift: HiFTGenerator,
    mel_chunk: Tensor,
    state: HiftStreamState,
    finalize: bool,
    generator: torch.Generator | None = None,
    source: Tensor | None = None,
) -> Tensor:
    """Vocode the next mel chunk and return the audio that is final now (float32, 24 kHz).

    `source` injects the whole excitation of this call (cache frames included, as the reference records
    it); otherwise it is drawn from `generator`. After `finalize` the held-back tail is included and the
    state is spent.
    """
    # mel_chunk: [1, 80, T_new] -> pcm: [N] (N = 480 * T_new - 3840 + previous tail, or all when final)
    mel = prepend_mel_cache(mel_chunk, state)
    speech, excitation = hift.infer(mel, cache_source=state.source_cache, source=source, generator=generator)
    return finish_chunk(speech, excitation, mel, state, finalize)


def prepend_mel_cache(mel_chunk: Tensor, state: HiftStreamState) -> Tensor:
    """The vocoder input of a chunk: the previous chunk's last mel frames, then the new ones."""
    # mel_chunk: [1, 80, T_new] -> [1, 80, cache + T_new]
    if state.finished:
        raise ValueError("hift_stream_step called after the final chunk")
    if state.mel_cache is None:
        return mel_chunk
    return torch.cat([state.mel_cache, mel_chunk.to(state.mel_cache)], dim=2)


def finish_chunk(
    speech: Tensor, excitation: Tensor, mel: Tensor, state: HiftStreamState, final: bool
) -> Tensor:
    """The chunk tail, one row (alone or out of a batch): cross-fade with the held-back tail, hold back
    the new tail, keep the mel and excitation caches (copies: a row keeps no batch tensor alive)."""
    # speech: [1, N], excitation: [1, 1, N], mel: [1, 80, T] -> pcm [N - 3840] (all of it when final)
    if state.speech_tail is not None:
        speech = fade_in_out(speech, state.speech_tail, hamming_window(2 * SPEECH_TAIL_SAMPLES))
    if final:
        state.mel_cache = state.source_cache = state.speech_tail = None
        state.finished = True
        return speech[0]
    if speech.shape[1] <= SPEECH_TAIL_SAMPLES or mel.shape[2] < MEL_CACHE_FRAMES:
        raise ValueError(
            f"a non-final HiFT chunk needs more than {MEL_CACHE_FRAMES} mel frames, got {mel.shape[2]}"
        )
    state.mel_cache = mel[:, :, -MEL_CACHE_FRAMES:].clone()
    state.source_cache = excitation[:, :, -SOURCE_CACHE_SAMPLES:].clone()
    state.speech_tail = speech[:, -SPEECH_TAIL_SAMPLES:].clone()
    return speech[0, :-SPEECH_TAIL_SAMPLES]
