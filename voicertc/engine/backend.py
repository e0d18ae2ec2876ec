"""What a backend implements; the worker, scheduler and sinks don't know which runs.

Two shapes, every method on the engine worker thread (but `voices()`):

* `BatchBackend[S]` — the serving shape. `begin(utt)` returns the utterance's typed state `S`;
  `plan(utt)` names the next unit of work (`voicertc.engine.work`) without side effects; `run(batch)`
  does a batch of compatible units that the scheduler formed, returning each utterance's `SynthStep`
  or exception (one utterance's failure is its own).
* `Backend` — the simple shape (Piper, the fake engine): `has_work` / `step` one utterance at a time.
  `StepBackendAdapter` plans one `Synth` unit per step for it, so the worker only knows the first shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from voicertc.engine.utterance import Utterance
from voicertc.engine.work import Job, Synth, Work

if TYPE_CHECKING:
    from voicertc.engine.voice_book import BackendVoiceBook

S = TypeVar("S")


@dataclass
class SynthStep:
    """What one backend step produced for one utterance."""

    pcm: list[np.ndarray] = field(default_factory=list)  # float32 mono pieces in [-1, 1]
    sample_rate_hz: int = 0
    done: bool = False  # no more audio will come for this utterance
    text: str = ""  # the text this step's audio speaks ("" = unknown / none); feeds heard_text


StepResult = SynthStep | BaseException


class Backend(Protocol):
    name: str
    features: frozenset[str]  # speak options it honours ("instruct", "speed")
    voice_book: BackendVoiceBook | None  # registers/deletes voices (`engine.voice_book`), or None

    def voices(self) -> list[str]:
        """Voice ids (thread-safe snapshot; may be called from any thread)."""
        ...

    def begin(self, utt: Utterance) -> None:
        """Set up `utt.backend_state`; raise UnknownVoiceError / InputError for bad requests."""
        ...

    def has_work(self, utt: Utterance, now_s: float) -> bool:
        """A step for `utt` would make progress now (given its text and input state)."""
        ...

    def wake_at(self, utt: Utterance) -> float | None:
        """Monotonic time at which `utt` becomes runnable without new input (None = only on input)."""
        ...

    def step(self, utt: Utterance, now_s: float) -> SynthStep:
        """Do one bounded piece of work for `utt`."""
        ...

    def release(self, utt: Utterance) -> None:
        """Free everything held for `utt` (called exactly once, also on cancel and failure)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class BatchBackend(Protocol[S]):
    name: str
    features: frozenset[str]
    voice_book: BackendVoiceBook | None

    def voices(self) -> list[str]: ...

    def begin(self, utt: Utterance[S]) -> S:
        """The new utterance's state (the worker stores it); raise UnknownVoiceError / InputError."""
        ...

    def plan(self, utt: Utterance[S], now_s: float) -> Work | None:
        """The next unit for `utt`, or None (only new input, or time, helps). No side effects."""
        ...

    def run(self, batch: Sequence[Job[S]], now_s: float) -> list[StepResult]:
        """Do the batch (units the scheduler grouped by `work.batch_key`); one result per job, in order."""
        ...

    def wake_at(self, utt: Utterance[S]) -> float | None: ...

    def bind_wake(self, wake: Callable[[], None]) -> None:
        """The worker's thread-safe `wake()`, given once the backend is built: a backend whose work
        arrives from another thread (a token streamer) calls it so that the worker, blocked on its
        queue, plans again (no backend polls). Others ignore it."""
        ...

    def release(self, utt: Utterance[S]) -> None:
        """Free everything held for `utt` (exactly once, also on cancel and failure)."""
        ...

    def captured_counts(self) -> dict[str, dict[str, int]]:
        """Per captured stage: replays, eager runs (shapes outside every bucket) and captures ({}: none)."""
        ...

    def close(self) -> None: ...


AnyBackend = Backend | BatchBackend[Any]  # what a worker runs: either shape


def is_batch_backend(backend: object) -> bool:
    return isinstance(backend, BatchBackend)


class StepBackendAdapter(Generic[S]):
    """A `Backend` seen as a `BatchBackend`: one `Synth` unit per step, run one utterance at a time."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.name = backend.name
        self.features = backend.features
        self.voice_book = backend.voice_book

    def bind_wake(self, wake: Callable[[], None]) -> None:
        """A simple backend's work only arrives through the worker's own queue: nothing to bind."""

    def voices(self) -> list[str]:
        return self.backend.voices()

    def begin(self, utt: Utterance[Any]) -> Any:
        self.backend.begin(utt)
        return utt.backend_state

    def plan(self, utt: Utterance[Any], now_s: float) -> Work | None:
        # has_work of a simple backend may take text into its state: the one side effect it is allowed
        return Synth() if self.backend.has_work(utt, now_s) else None

    def run(self, batch: Sequence[Job[Any]], now_s: float) -> list[StepResult]:
        results: list[StepResult] = []
        for job in batch:
            try:
                results.append(self.backend.step(job.utt, now_s))
            except Exception as exc:  # noqa: BLE001 - isolated per utterance
                results.append(exc)
        return results

    def wake_at(self, utt: Utterance[Any]) -> float | None:
        return self.backend.wake_at(utt)

    def release(self, utt: Utterance[Any]) -> None:
        self.backend.release(utt)

    def captured_counts(self) -> dict[str, dict[str, int]]:
        return {}  # a simple backend captures nothing

    def close(self) -> None:
        self.backend.close()


def as_batch_backend(backend: object) -> BatchBackend[Any]:
    if is_batch_backend(backend):
        return backend  # type: ignore[return-value]
    return StepBackendAdapter(backend)  # type: ignore[arg-type]
