"""Test doubles shared by engine tests: a recording sink with a switchable high-water mark."""

from __future__ import annotations

import threading

import numpy as np

from voicertc.engine.protocol import EngineEvent


class RecordingSink:
    """An AudioSink that keeps what it is given; `room` simulates backpressure."""

    def __init__(self, room_samples: int | None = None) -> None:
        self.generation = 0
        self.pcm: dict[str, list[np.ndarray]] = {}
        self.rates: set[int] = set()
        self.ended: list[str] = []
        self.aborted: list[str] = []
        self.room_samples = room_samples
        self.listener = None
        self.lock = threading.Lock()

    def write(self, pcm, sample_rate_hz, utterance_id, generation) -> bool:
        with self.lock:
            if generation != self.generation:
                return False
            self.pcm.setdefault(utterance_id, []).append(np.asarray(pcm, np.float32).copy())
            self.rates.add(sample_rate_hz)
            return True

    def end_utterance(self, utterance_id, generation) -> None:
        self.ended.append(utterance_id)

    def mark_text(self, utterance_id, generation, text) -> None:
        pass  # heard-text marks: tests/test_listen_heard_text.py records them

    def abort_utterance(self, utterance_id, generation) -> None:
        self.aborted.append(utterance_id)

    def has_room(self) -> bool:
        return self.room_samples is None or self.queued() < self.room_samples

    @property
    def queued_ms(self) -> float:
        return 1000.0 * self.queued() / 24000

    def queued(self) -> int:
        with self.lock:
            return sum(len(p) for chunks in self.pcm.values() for p in chunks)

    def drain(self) -> None:
        """Consume everything (like playback) and tell the engine there is room."""
        with self.lock:
            self.pcm.clear()
        if self.listener:
            self.listener()

    def clear(self) -> None:
        with self.lock:
            self.generation += 1
            self.pcm.clear()

    def set_space_listener(self, callback) -> None:
        self.listener = callback

    def samples(self, utterance_id: str) -> np.ndarray:
        chunks = self.pcm.get(utterance_id, [])
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


class EventLog:
    """Collects engine events (from the worker thread) and lets a test wait for terminal ones."""

    def __init__(self) -> None:
        self.events: list[EngineEvent] = []
        self.cond = threading.Condition()

    def __call__(self, event: EngineEvent) -> None:
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def of(self, utterance_id: str) -> list[EngineEvent]:
        with self.cond:
            return [e for e in self.events if e.utterance_id == utterance_id]

    def wait_for(self, utterance_id: str, kind: type, timeout_s: float = 20.0) -> EngineEvent:
        """The first event of type `kind` for the utterance (waiting for it)."""

        def found() -> EngineEvent | None:
            return next(
                (e for e in self.events if e.utterance_id == utterance_id and isinstance(e, kind)), None
            )

        with self.cond:
            assert self.cond.wait_for(lambda: found() is not None, timeout_s), f"no {kind.__name__} event"
            event = found()
        assert event is not None
        return event

    def wait_terminal(self, utterance_ids, timeout_s: float = 20.0) -> None:
        from voicertc.engine import Cancelled, Done, Failed

        def all_done() -> bool:
            ended = {e.utterance_id for e in self.events if isinstance(e, (Done, Cancelled, Failed))}
            return set(utterance_ids) <= ended

        with self.cond:
            assert self.cond.wait_for(all_done, timeout_s), f"no terminal event for some of {utterance_ids}"
