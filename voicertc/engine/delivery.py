"""One utterance's delivery outlet: the audio it made, held until the sink has room, written in order.

`Delivery` is the part of an utterance's state that both owners share: the engine worker's `Utterance`
(in-process synthesis) and the remote client's utterance (audio streamed from a replica) extend it.
Each is owned by one thread (the engine thread, the client's loop). The owner holds PCM pieces and text
marks, calls `write()` when the sink may have room, and acts on what it returns:

* the first piece written is first audio: `write()` emits `FirstAudio` with TTFA = first audio -
  first text (or the open, when the text came with it);
* `Wrote.CLEARED`: the sink was cleared under the utterance (an interrupt bumped its generation): the
  owner finishes it as `Cancelled`;
* once the producer is done and nothing is held, `end()` marks the end for playback (a `Done`
  follows); an utterance that ends otherwise is `abort()`ed (the sink frees its state).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from voicertc.engine.protocol import AudioSink, EngineEvent, FirstAudio

logger = logging.getLogger(__name__)


class Wrote(Enum):
    """What `Delivery.write` did."""

    ALL = "all"  # nothing is held any more
    FULL = "full"  # the sink has no room; the rest waits for its space listener
    CLEARED = "cleared"  # the sink was cleared under the utterance (interrupt): finish it as Cancelled


@dataclass(kw_only=True, eq=False)
class Delivery:
    """Held PCM pieces and text marks of one utterance, and when its text and audio first came."""

    utterance_id: str
    sink: AudioSink
    generation: int
    opened_s: float
    first_text_s: float | None = None
    first_audio_s: float | None = None
    held: deque[tuple[np.ndarray, int] | str] = field(default_factory=deque)
    written_samples: int = 0  # at the rate of the last piece (one rate per utterance)
    written_ms: float = 0.0

    def hold(self, pcm: np.ndarray, sample_rate_hz: int) -> None:
        self.held.append((pcm, sample_rate_hz))

    def hold_mark(self, text: str) -> None:
        """The text whose audio starts with the next piece held (feeds the call's heard text)."""
        self.held.append(text)

    def note_text(self, text: str, now_s: float) -> None:
        """Text arrived: the first that is not blank starts the TTFA clock."""
        if self.first_text_s is None and text.strip():
            self.first_text_s = now_s

    @property
    def ttfa_s(self) -> float | None:
        if self.first_audio_s is None:
            return None
        return self.first_audio_s - (self.first_text_s if self.first_text_s is not None else self.opened_s)

    def write(self, emit: Callable[[EngineEvent], None], clock: Callable[[], float]) -> Wrote:
        """Write what is held while the sink has room (text marks in their place)."""
        while self.held:
            if not self.sink.has_room():
                return Wrote.FULL
            item = self.held.popleft()
            if isinstance(item, str):
                self.sink.mark_text(self.utterance_id, self.generation, item)
                continue
            pcm, rate_hz = item
            if not self.sink.write(pcm, rate_hz, self.utterance_id, self.generation):
                return Wrote.CLEARED
            self.written_samples += len(pcm)
            self.written_ms += 1000.0 * len(pcm) / rate_hz
            if self.first_audio_s is None:
                self.first_audio_s = clock()
                emit(FirstAudio(self.utterance_id, ttfa_ms=1000.0 * (self.ttfa_s or 0.0)))
        return Wrote.ALL

    def end(self) -> None:
        """All audio is written: mark the end for playback."""
        self.sink.end_utterance(self.utterance_id, self.generation)

    def abort(self) -> None:
        """The utterance ended early: drop what is held; the sink frees its state (never raises)."""
        self.held.clear()
        try:
            self.sink.abort_utterance(self.utterance_id, self.generation)
        except Exception:
            logger.exception("utterance %s: sink abort failed", self.utterance_id)
