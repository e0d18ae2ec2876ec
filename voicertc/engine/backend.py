"""The synthesis step a backend implements; the worker, schedule and sinks don't know which runs.

Every method runs on the engine worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from voicertc.engine.utterance import Utterance


@dataclass
class SynthStep:
    """What one backend step produced for one utterance."""

    pcm: list[np.ndarray] = field(default_factory=list)  # float32 mono pieces in [-1, 1]
    sample_rate_hz: int = 0
    done: bool = False  # no more audio will come for this utterance
    text: str = ""  # the text this step's audio speaks ("" = unknown / none); feeds heard_text


class Backend(Protocol):
    name: str

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
