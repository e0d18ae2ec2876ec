"""Typed units of engine work: what a backend plans for one utterance, and what the scheduler batches.

A backend's `plan(utt)` looks at one utterance's state (no side effects) and names the next unit; the
scheduler groups compatible units of several utterances into one batch, and the backend's `run(batch)`
does them together. Units are frozen values: equal units of different utterances can share a batch.

* `Frontend`  text normalisation / tokenisation / session set-up (cheap, host only);
* `Prefill`   start an LLM call on a new text segment;
* `Decode`    LLM decode steps (batched across utterances; `until_chunk` / `chunk_advance` describe
  the flow chunk the decode is heading to, so the scheduler can pull a partner forward);
* `FlowChunk` one flow chunk, advancing the flow state by `advance_tokens` (batched when equal); a
  chunk whose Euler steps do not fit in one engine step goes on in units that name its `solve`, which
  batch with the chunk's other members only;
* `Vocode`    HiFT for the mel a `FlowChunk` produced (batched across utterances of equal `frames`); one
  that does not fit in an engine step goes on in units that name its `solve`, as a `FlowChunk`;
* `VoicePrompt` build the utterance's voice's prompt caches (model state of the prompt: a stored voice at
  its first use) a part at a time; units of several utterances share a batch (one build per voice);
* `Finish`    nothing left to synthesise: the utterance is done;
* `Synth`     one whole step of a backend that does not split its work (Piper, the fake engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from voicertc.engine.utterance import Utterance


@dataclass(frozen=True)
class Frontend:
    pass


@dataclass(frozen=True)
class Prefill:
    pass


@dataclass(frozen=True)
class Decode:
    until_chunk: int = 0  # tokens still to decode before the next flow chunk is ready (0 = unknown)
    chunk_advance: int = 0  # the advance of that chunk


@dataclass(frozen=True)
class FlowChunk:
    advance_tokens: int
    final: bool = False
    solve: int = 0  # != 0: the rest of a started chunk (its batch's number); 0: a chunk to start


@dataclass(frozen=True)
class Vocode:
    frames: int = 0  # the vocoder input's length (rows batch only when equal: the vocoder is non-causal)
    final: bool = False
    solve: int = 0  # != 0: the rest of a started vocoder batch (its number), as `FlowChunk.solve`


@dataclass(frozen=True)
class VoicePrompt:
    pass


@dataclass(frozen=True)
class Finish:
    pass


@dataclass(frozen=True)
class Synth:
    pass


Work = Frontend | Prefill | Decode | FlowChunk | Vocode | VoicePrompt | Finish | Synth

S = TypeVar("S")


@dataclass(frozen=True, eq=False)
class Job(Generic[S]):
    """One utterance's planned unit in a batch (identity, not value, equality)."""

    utt: Utterance[S]
    work: Work


def batch_key(work: Work) -> tuple[object, ...] | None:
    """Units with the same key may run as one batch; None = always alone (`Synth`: a simple backend's
    step). The cheap host-only transitions (`Frontend`, `Prefill`, `Finish`) share an iteration too."""
    if isinstance(work, Frontend | Prefill | Finish):
        return (type(work).__name__,)
    if isinstance(work, Decode):
        return ("decode",)
    if isinstance(work, FlowChunk):
        return ("flow", work.advance_tokens, work.final, work.solve)
    if isinstance(work, Vocode):
        return ("vocode", work.frames, work.solve)
    if isinstance(work, VoicePrompt):
        return ("voice_prompt",)
    return None


def stage_name(work: Work) -> str:
    """The stage label of a unit (metrics)."""
    return type(work).__name__.lower()
