"""CosyVoice3's causal HiFT as captured static-shape steps: one replay per (rows, stream phase) bucket.

Runs on the engine thread. A vocoder step of the incremental causal HiFT (`hift.causal`) is the
excitation (the f0 predictor, then each row's sine/noise source from its own phase sum and noise
position) and the synthesis (source STFT, `conv_pre`, the upsampling stages fused with the source,
`conv_post`, iSTFT, overlap-add, hold-back): hundreds of small kernels on a GPU. The excitation stays
eager (it is per row and reproducible per utterance); the synthesis is replayed.

The synthesis is a function of the stream state's tensors (conv tails, pending fusion halves, STFT
head / tail, overlap-add sums, held-back PCM) and of a few host counters. Its shapes and branches
depend on the counters only through the stream's *phase* (`synthesis_key`: the carried offsets relative
to the stream position, the start-up flags), never on absolute positions, so one capture per (rows,
phase, shapes) serves every later call in that phase: its inputs are the state's tensors (rows first,
padded with zero rows up to a power of two: rows are independent), its outputs the new tensors, and
the counters advance by the deltas the captured run made. The window envelope, one for all rows, travels
as a row-broadcast. A final chunk (its length is what the utterance had left: one of many, met once per
utterance), a call with more rows than `max_rows` or past the memory budget runs eagerly, counted.
`CapturedCausalHift` is installed as `CausalHiFTGenerator.synthesis_runner`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.accel.captured import (
    Capture,
    GraphBudget,
    StageStats,
    StaticSteps,
    row_bucket,
    run_eagerly,
)
from voicertc.backends.cosyvoice.hift.causal import CausalHiFTGenerator, HiftStreamState
from voicertc.backends.cosyvoice.hift.causal_batch import COUNTERS, START_FRAMES
from voicertc.engine.parts import run_to_end

FLAGS = ("reflected", "finished")
CARRIED = ("stft_head", "stft_tail", "ola", "env", "pcm")


def state_tensors(state: HiftStreamState) -> list[tuple[str, Tensor]]:
    """The stream state's tensors by name, in a fixed order (conv tails by slot, pending halves by
    stage, then the STFT / overlap-add / PCM carries that exist)."""
    named = [(f"tail:{slot}", t) for slot, t in sorted(state.tails.items())]
    for key, (a, b) in sorted(state.pending.items()):
        named += [(f"pending:{key}:0", a), (f"pending:{key}:1", b)]
    named += [(name, t) for name in CARRIED if (t := getattr(state, name)) is not None]
    return named


def set_state_tensors(state: HiftStreamState, names: tuple[str, ...], tensors: list[Tensor]) -> None:
    """`state_tensors`' inverse: the state's tensors replaced by `tensors` (named `names`)."""
    tails: dict[int, Tensor] = {}
    halves: dict[int, list[Tensor]] = {}
    carried: dict[str, Tensor | None] = dict.fromkeys(CARRIED)
    for name, t in zip(names, tensors, strict=True):
        kind, _, rest = name.partition(":")
        if kind == "tail":
            tails[int(rest)] = t
        elif kind == "pending":
            halves.setdefault(int(rest.partition(":")[0]), []).append(t)
        else:
            carried[kind] = t
    state.tails = tails
    state.pending = {key: (pair[0], pair[1]) for key, pair in halves.items()}
    for name, value in carried.items():
        setattr(state, name, value)


def synthesis_key(hift: CausalHiFTGenerator, state: HiftStreamState) -> Hashable:
    """What, besides the tensors' shapes, picks the synthesis's shapes and branches (read after the
    excitation of the call): the start-up flags, the carried offsets relative to the stream position,
    which carries exist. Two calls with equal keys and shapes run the same kernels on the same shapes."""
    c = hift.config
    spf, hop = c.samples_per_frame, c.istft_hop
    return (
        state.final,
        state.finished,
        state.reflected,
        min(state.mel_frames, START_FRAMES),
        state.mel_frames * spf - state.emitted,
        state.istft_frames * hop - state.ola_start,
        min(state.ola_start, c.istft_n_fft),
        tuple(name for name, _ in state_tensors(state)),
    )


@dataclass(frozen=True)
class _Phase:
    """A phase's host side, as the captured run saw it: the counters it started from, and what it made
    of them (the counters' deltas, the flags after, the names of the new state's tensors)."""

    counters: tuple[int, ...]
    final: bool
    reflected: bool
    deltas: tuple[int, ...] = ()
    flags: tuple[bool, ...] = ()
    names_out: tuple[str, ...] = ()


class CapturedCausalHift:
    """`CausalHiFTGenerator.synthesis_runner`: the synthesis replayed per (rows, phase, shapes) bucket."""

    def __init__(
        self,
        hift: CausalHiFTGenerator,
        *,
        max_rows: int = 32,
        capture: Capture = run_eagerly,
        budget: GraphBudget | None = None,
    ) -> None:
        self.hift = hift
        self.max_rows = max_rows
        self.steps = StaticSteps(
            "causal hift synthesis", self._synthesis, 0, 0, capture=capture, budget=budget
        )  # every input and output has its rows first
        self._phases: dict[Hashable, _Phase] = {}
        self._current: tuple[Hashable, tuple[str, ...]] | None = None  # the call's phase and input names

    @property
    def stats(self) -> StageStats:
        return self.steps.stats

    def _synthesis(self, mel: Tensor, excitation: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
        """The static step: the synthesis on a state rebuilt from the phase's captured counters (never
        the call's: a replay runs what the capture ran) and the input tensors."""
        assert self._current is not None
        key, names = self._current
        phase = self._phases[key]
        state = HiftStreamState(final=phase.final, reflected=phase.reflected)
        for name, value in zip(COUNTERS, phase.counters, strict=True):
            setattr(state, name, value)
        rows = mel.shape[0]
        set_state_tensors(state, names, [_unshared(name, t) for name, t in zip(names, tensors, strict=True)])
        out = run_to_end(self.hift.synthesis_parts(mel, excitation, state))
        named = state_tensors(state)
        self._phases[key] = _Phase(
            phase.counters, phase.final, phase.reflected,
            deltas=tuple(getattr(state, n) - c for n, c in zip(COUNTERS, phase.counters, strict=True)),
            flags=tuple(getattr(state, f) for f in FLAGS),
            names_out=tuple(name for name, _ in named),
        )  # fmt: skip
        return (out, *(_shared(name, t, rows) for name, t in named))

    @torch.inference_mode()
    def warm(self, chunk_frames: list[int], rows: list[int], like: Tensor) -> int:
        """Capture the phases an utterance meets in its first chunks (`chunk_frames` new mel frames each,
        not final), at each row count (start-up, while installed as the runner); how many were captured.
        `like`: a tensor of the vocoder's device."""
        from voicertc.backends.cosyvoice.hift.causal_batch import step_batch

        before = self.steps.stats.captures
        for r in sorted(rows, reverse=True):
            if row_bucket(r, self.max_rows) != r:
                continue
            states = [HiftStreamState() for _ in range(r)]
            for frames in chunk_frames:
                mel = like.new_zeros(1, self.hift.config.in_channels, frames, dtype=torch.float32)
                step_batch(self.hift, [mel] * r, states, final=False)
                if self.steps.stats.failed is not None:
                    return self.steps.stats.captures - before
        return self.steps.stats.captures - before

    @torch.inference_mode()
    def __call__(self, mel: Tensor, excitation: Tensor, state: HiftStreamState) -> Tensor:
        # mel [B, 80, n] float32, excitation [B, 1, S] -> the samples ready now [B, N]; `state` advanced
        rows = mel.shape[0]
        padded = row_bucket(rows, self.max_rows)
        if padded is None or state.final:  # a final chunk's length is the utterance's: one of ~100,
            self.steps.stats.eager += 1  # met once per utterance, eager rather than a capture each
            return run_to_end(self.hift.synthesis_parts(mel, excitation, state))
        key = synthesis_key(self.hift, state)
        named = state_tensors(state)
        if key not in self._phases:
            counters = tuple(getattr(state, n) for n in COUNTERS)
            self._phases[key] = _Phase(counters, state.final, state.reflected)
        self._current = (key, tuple(name for name, _ in named))
        inputs = [mel, excitation, *(_shared(name, t, rows) for name, t in named)]
        outputs = self.steps.run(padded, inputs, branch=key)
        if outputs is None:
            return run_to_end(self.hift.synthesis_parts(mel, excitation, state))
        phase = self._phases[key]
        for name, delta in zip(COUNTERS, phase.deltas, strict=True):
            setattr(state, name, getattr(state, name) + delta)
        for name, flag in zip(FLAGS, phase.flags, strict=True):
            setattr(state, name, flag)
        out, *tensors = outputs
        names = phase.names_out
        set_state_tensors(state, names, [_unshared(n, t) for n, t in zip(names, tensors, strict=True)])
        return out


def _shared(name: str, t: Tensor, rows: int) -> Tensor:
    """The window envelope ([1, n], one for every row) as a row-broadcast [rows, n]; the rest as is."""
    return t.expand(rows, -1) if name == "env" else t


def _unshared(name: str, t: Tensor) -> Tensor:
    return t[:1] if name == "env" else t
