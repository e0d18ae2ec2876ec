"""Per-utterance state: one dataclass, owned by the engine worker thread (never touched elsewhere)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from voicertc.engine.protocol import DEFAULT_OPTIONS, AudioSink, EventCallback, SpeakOptions

S = TypeVar("S")


@dataclass
class Utterance(Generic[S]):
    """Everything the worker knows about one utterance.

        Invariants: `text` holds text pushed but not yet taken by the backend; `pending_pcm` holds audio
        synthesized but not yet written to the sink (backpressure); `backend_state` (the backend's own state
    type `S`, set from `begin`) belongs to the backend.
    """

    utterance_id: str
    voice: str
    sink: AudioSink
    on_event: EventCallback
    generation: int
    opened_s: float
    text: str = ""
    text_chars_total: int = 0
    input_ended: bool = False
    first_text_s: float | None = None
    first_audio_s: float | None = None
    synthesis_done: bool = False
    audio_samples: int = 0  # written to the sink, at the backend's sample rate
    synth_audio_s: float = 0.0  # accepted from the backend (capped by limits.max_utterance_s)
    failure: Exception | None = None  # ends the utterance as Failed once its pending audio is written
    sample_rate_hz: int = 0
    chunks: int = 0
    steps: int = 0  # times the scheduler served this utterance (fairness)
    pending_pcm: deque[tuple[np.ndarray, int]] = field(default_factory=deque)
    backend_state: S | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    options: SpeakOptions = DEFAULT_OPTIONS  # instruct / speed of the speak request

    def take_text(self) -> str:
        text, self.text = self.text, ""
        return text

    @property
    def audio_ms(self) -> float:
        return 1000.0 * self.audio_samples / self.sample_rate_hz if self.sample_rate_hz else 0.0

    def add_metric(self, name: str, seconds: float) -> None:
        """Accumulate a stage's time (seconds) under `name`."""
        self.metrics[name] = self.metrics.get(name, 0.0) + seconds
