"""Batched incremental causal HiFT (CosyVoice3): several utterances' next mel chunks in one forward.

Runs on the engine thread. Each utterance keeps its own `HiftStreamState`; rows are batched when their
states are in the same *phase*: the same new-chunk length, the same `final`, and every carried tensor
(conv tails, pending fusion halves, STFT head/tail, overlap-add sums, held-back PCM) of the same shape,
with the same offsets relative to the stream position (`phase_key`). Then nothing is padded: the
batched state is the rows' states stacked, each row's excitation reads its own phase sum and noise
position, and a batch computes what each row computes alone (up to the float rounding of batched
convolutions). Utterances at different points of their speech batch fine: only the offsets of the
carried data must agree, not the absolute positions.

`step_batch` leaves the rows' states untouched until the batched forward has succeeded, so a failed
batch can be retried row by row.
"""

from __future__ import annotations

from collections.abc import Generator, Hashable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.hift.causal import (
    F0_LOOKAHEAD,
    HELD_BACK_FRAMES,
    CausalHiFTGenerator,
    HiftStreamState,
)
from voicertc.engine.parts import run_to_end

T = TypeVar("T", bound=Tensor | None)
START_FRAMES = HELD_BACK_FRAMES + F0_LOOKAHEAD + 1  # beyond this many frames the absolute count is irrelevant


def _shape(t: Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(t.shape)


def phase_key(hift: CausalHiFTGenerator, state: HiftStreamState, frames: int, final: bool) -> Hashable:
    """Rows with equal keys batch exactly: the next chunk's length and kind, every carried tensor's shape
    and the carried offsets relative to the stream position."""
    c = hift.config
    spf, hop = c.samples_per_frame, c.istft_hop
    return (
        frames,
        final,
        state.finished,
        state.reflected,
        min(state.mel_frames, START_FRAMES),
        state.mel_frames * spf - state.emitted,
        state.mel_frames * spf - state.source_samples,
        state.mel_frames - state.source.frames,
        state.istft_frames * hop - state.ola_start,
        min(state.ola_start, c.istft_n_fft),
        tuple(sorted((slot, _shape(t)) for slot, t in state.tails.items())),
        tuple(sorted((key, _shape(a), _shape(b)) for key, (a, b) in state.pending.items())),
        _shape(state.stft_head),
        _shape(state.stft_tail),
        _shape(state.ola),
        _shape(state.pcm),
        state.source.phase_sum is None,
    )


def _stacked(tensors: Sequence[T]) -> T:
    first = tensors[0]
    if first is None:
        return first
    return torch.cat(tensors, dim=0)  # type: ignore[arg-type,return-value]


def _row(t: T, row: int) -> T:
    return t if t is None else t[row : row + 1]  # type: ignore[return-value]


def _merged(states: Sequence[HiftStreamState]) -> HiftStreamState:
    first = states[0]
    return HiftStreamState(
        mel_frames=first.mel_frames,
        emitted=first.emitted,
        tails={slot: torch.cat([s.tails[slot] for s in states]) for slot in first.tails},
        pending={
            key: (
                torch.cat([s.pending[key][0] for s in states]),
                torch.cat([s.pending[key][1] for s in states]),
            )
            for key in first.pending
        },
        source_samples=first.source_samples,
        stft_head=_stacked([s.stft_head for s in states]),
        stft_tail=_stacked([s.stft_tail for s in states]),
        reflected=first.reflected,
        ola=_stacked([s.ola for s in states]),
        env=first.env,  # the window envelope depends on positions only: equal in one phase
        ola_start=first.ola_start,
        istft_frames=first.istft_frames,
        pcm=_stacked([s.pcm for s in states]),
        final=first.final,
        finished=first.finished,
    )


COUNTERS = ("mel_frames", "emitted", "source_samples", "ola_start", "istft_frames")


def _split(before: dict[str, int], merged: HiftStreamState, states: Sequence[HiftStreamState]) -> None:
    """Write the batched result back: row slices of the tensors, the counters advanced by the batch's
    deltas (each row keeps its own absolute position)."""
    deltas = {name: getattr(merged, name) - before[name] for name in COUNTERS}
    for row, state in enumerate(states):
        for name, delta in deltas.items():
            setattr(state, name, getattr(state, name) + delta)
        state.tails = {slot: t[row : row + 1] for slot, t in merged.tails.items()}
        state.pending = {k: (a[row : row + 1], b[row : row + 1]) for k, (a, b) in merged.pending.items()}
        state.stft_head, state.stft_tail = _row(merged.stft_head, row), _row(merged.stft_tail, row)
        state.ola, state.env, state.pcm = _row(merged.ola, row), merged.env, _row(merged.pcm, row)
        state.reflected, state.final, state.finished = merged.reflected, merged.final, merged.finished
        state.work_frames = merged.work_frames


def step_batch(
    hift: CausalHiFTGenerator, mels: Sequence[Tensor], states: Sequence[HiftStreamState], *, final: bool
) -> list[Tensor]:
    """`hift.step` for rows in one phase (`phase_key`); -> each row's new samples [N]."""
    # mels: B x [1, 80, n] -> B x pcm [N]
    with torch.inference_mode():
        return run_to_end(step_batch_parts(hift, mels, states, final=final))


def step_batch_parts(
    hift: CausalHiFTGenerator, mels: Sequence[Tensor], states: Sequence[HiftStreamState], *, final: bool
) -> Generator[None, None, list[Tensor]]:
    """`step_batch` in parts (`CausalHiFTGenerator.step_rows_parts` on the merged state); the rows'
    states change only in the last part, which returns each row's samples. Run each `next()` under
    inference mode."""
    if len(states) != len(mels) or not states:
        raise ValueError("step_batch needs one mel chunk per state (and at least one)")
    keys = {phase_key(hift, s, m.shape[2], final) for s, m in zip(states, mels, strict=True)}
    if len(keys) != 1:
        raise ValueError("a causal HiFT batch needs rows in one stream phase (see phase_key)")
    merged = _merged(states)
    before = {name: getattr(merged, name) for name in COUNTERS}
    sources = [s.source.copy() for s in states]
    pcm, _ = yield from hift.step_rows_parts(
        torch.cat([m.float() for m in mels]), merged, sources, final=final
    )
    _split(before, merged, states)
    for state, source in zip(states, sources, strict=True):
        state.source = source
    return [pcm[row] for row in range(len(states))]
