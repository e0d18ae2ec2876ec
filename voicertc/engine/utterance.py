"""Per-utterance state: one dataclass, owned by the engine worker thread (never touched elsewhere)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from voicertc.engine.delivery import Delivery
from voicertc.engine.protocol import DEFAULT_OPTIONS, EventCallback, SpeakOptions

S = TypeVar("S")


@dataclass(kw_only=True, eq=False)
class Utterance(Delivery, Generic[S]):
    """Everything the worker knows about one utterance (its delivery outlet included).

    Invariants: `text` holds text pushed but not yet taken by the backend; `held` (from `Delivery`)
    holds audio synthesized but not yet written to the sink (backpressure); `backend_state` (the
    backend's own state, type `S`, set from `begin`) belongs to the backend.
    """

    voice: str
    on_event: EventCallback
    text: str = ""
    text_chars_total: int = 0
    input_ended: bool = False
    synthesis_done: bool = False
    synth_audio_s: float = 0.0  # accepted from the backend (capped by limits.max_utterance_s)
    failure: Exception | None = None  # ends the utterance as Failed once its pending audio is written
    chunks: int = 0
    steps: int = 0  # times the scheduler served this utterance (fairness)
    steps_at_audio: int = 0  # `steps` when its synthesis last made audio
    longest_audio_gap_steps: int = 0  # the most units it ever went between two pieces of audio
    backend_state: S | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    options: SpeakOptions = DEFAULT_OPTIONS  # instruct / speed of the speak request

    def take_text(self) -> str:
        text, self.text = self.text, ""
        return text

    @property
    def audio_ms(self) -> float:
        return self.written_ms

    def add_metric(self, name: str, seconds: float) -> None:
        """Accumulate a stage's time (seconds) under `name`."""
        self.metrics[name] = self.metrics.get(name, 0.0) + seconds
