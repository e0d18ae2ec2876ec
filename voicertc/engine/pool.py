"""EnginePool: several engine workers, each owning its own backend, behind the one `Engine` seam.

Why: a CPU voice (Piper: onnxruntime with one intra-op thread) synthesizes one piece at a time per
worker, so when many calls start speaking together the last one waits for every first clause before
its own. N workers on N cores serve N at once (`engine.workers`; the GPU backend keeps one worker,
the single owner of its device).

Routing: while a sink (a call's ring) has an open utterance, its next ones go to the same worker, so
they stay in order on the ring and one worker is its space listener; a sink with none open goes to
the least busy worker (ties in turn). Every utterance id routes to its worker until its terminal
event. The open-utterance limit is the pool's; `open_count` drops at `cancel()` time.

Commands: `submit_command(fn)` runs `fn(backend)` on the first worker's engine thread (one answer, e.g. a
query); `broadcast_command(fn)` runs it on every worker (state every backend must hold, e.g. a newly
registered voice) and returns one future per worker.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, TypeVar

from voicertc.engine.backend import Backend
from voicertc.engine.batch_stats import BatchStats
from voicertc.engine.protocol import (
    AudioSink,
    Cancelled,
    Done,
    EngineEvent,
    EventCallback,
    Failed,
    SpeakOptions,
)
from voicertc.engine.step_stats import StepStats
from voicertc.engine.voice_book import VoiceInfo
from voicertc.engine.worker import EngineWorker
from voicertc.errors import InputError

if TYPE_CHECKING:
    from voicertc.audio.decode import Clip

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EnginePool:
    """Implements `voicertc.engine.protocol.Engine` over `workers` (each with its own backend)."""

    def __init__(self, workers: list[EngineWorker], max_utterances: int = 64) -> None:
        if not workers:
            raise ValueError("an engine pool needs at least one worker")
        self.workers = workers
        self.name = workers[0].name
        self.max_utterances = max_utterances
        self._lock = threading.Lock()
        self._routes: dict[str, tuple[int, int]] = {}  # open utterance id -> (worker index, id(sink))
        self._counted: set[str] = set()  # open and not cancelled: what the limit counts
        self._next = 0  # where the tie-break between equally busy workers starts

    def start(self) -> None:
        """Start every worker (each builds its backend on its own thread); all or none."""
        started: list[EngineWorker] = []
        try:
            for worker in self.workers:
                worker.start()
                started.append(worker)
        except BaseException:
            for worker in started:
                worker.stop()
            raise
        logger.info("engine pool %s started with %d workers", self.name, len(self.workers))

    def stop(self, timeout_s: float = 10.0) -> None:
        for worker in self.workers:
            worker.stop(timeout_s)

    @property
    def step_stats(self) -> StepStats:
        """Every worker's engine step times together."""
        return StepStats.merged(worker.step_stats for worker in self.workers)

    @property
    def batch_stats(self) -> BatchStats:
        """The workers' batch statistics, summed."""
        return BatchStats.merged(worker.batch_stats for worker in self.workers)

    def voices(self) -> list[str]:
        return self.workers[0].voices()

    @property
    def running(self) -> bool:
        return all(worker.running for worker in self.workers)

    def supports(self, feature: str) -> bool:
        return self.workers[0].supports(feature)

    @property
    def ready(self) -> bool:
        return all(worker.ready for worker in self.workers)

    @property
    def not_ready_reason(self) -> str:
        return next((reason for w in self.workers if (reason := w.not_ready_reason)), "")

    @property
    def retry_after_s(self) -> int:
        return self.workers[0].retry_after_s

    def resolve_voice(self, voice: str | None) -> str:
        return self.workers[0].resolve_voice(voice)

    def open_utterance(
        self,
        voice: str | None,
        sink: AudioSink,
        on_event: EventCallback,
        utterance_id: str | None = None,
        options: SpeakOptions | None = None,
    ) -> str:
        uid = utterance_id or uuid.uuid4().hex[:12]

        def routed(event: EngineEvent) -> None:
            if isinstance(event, Done | Cancelled | Failed):
                with self._lock:
                    self._routes.pop(uid, None)
                    self._counted.discard(uid)
            on_event(event)

        with self._lock:
            if len(self._counted) >= self.max_utterances:
                raise InputError(f"too many open utterances (limit {self.max_utterances})")
            index = self._worker_for(sink)
            self._routes[uid] = (index, id(sink))
            self._counted.add(uid)
        worker = self.workers[index]
        try:
            return worker.open_utterance(voice, sink, routed, uid, options)
        except BaseException:
            with self._lock:
                self._routes.pop(uid, None)
                self._counted.discard(uid)
            raise

    def push_text(self, utterance_id: str, text: str, end: bool = False) -> None:
        if (worker := self._route(utterance_id)) is not None:
            worker.push_text(utterance_id, text, end)

    def end_input(self, utterance_id: str) -> None:
        if (worker := self._route(utterance_id)) is not None:
            worker.end_input(utterance_id)

    def cancel(self, utterance_id: str) -> None:
        with self._lock:
            self._counted.discard(utterance_id)
        if (worker := self._route(utterance_id)) is not None:
            worker.cancel(utterance_id)

    @property
    def open_count(self) -> int:
        """Open utterances over all workers (thread-safe); drops at `cancel()` time."""
        with self._lock:
            return len(self._counted)

    def submit_command(self, fn: Callable[[Backend], T]) -> Future[T]:
        """Run `fn(backend)` on the first worker's engine thread (see the module docstring)."""
        return self.workers[0].submit_command(fn)

    def list_voices(self) -> Future[list[VoiceInfo]]:
        return self.workers[0].list_voices()

    def register_voice(
        self, clip: Clip, transcript: str | None, voice_id: str | None, name: str
    ) -> Future[VoiceInfo]:
        """On the first worker (its voices dir is the pool's; the others load stored voices at start)."""
        return self.workers[0].register_voice(clip, transcript, voice_id, name)

    def delete_voice(self, voice_id: str) -> Future[None]:
        return self.workers[0].delete_voice(voice_id)

    def broadcast_command(self, fn: Callable[[Backend], T]) -> list[Future[T]]:
        """Run `fn(backend)` on every worker's engine thread; one future per worker, in worker order."""
        return [worker.submit_command(fn) for worker in self.workers]

    def say(self, voice: str | None, sink: AudioSink, on_event: EventCallback, text: str) -> str:
        uid = self.open_utterance(voice, sink, on_event)
        self.push_text(uid, text, end=True)
        return uid

    # ----------------------------------------------------------------------------------- internals
    def _route(self, utterance_id: str) -> EngineWorker | None:
        """The worker of an open utterance; None once it has ended (late commands are no-ops)."""
        with self._lock:
            route = self._routes.get(utterance_id)
        return None if route is None else self.workers[route[0]]

    def _worker_for(self, sink: AudioSink) -> int:
        """The worker already serving the sink, else the one with the fewest open utterances (under
        `_lock`; the sink is alive while it has a route, so its id is not reused meanwhile)."""
        busy = [0] * len(self.workers)
        for index, sink_id in self._routes.values():
            if sink_id == id(sink):
                return index
            busy[index] += 1
        count = len(self.workers)
        index = min(range(count), key=lambda i: (busy[i], (i - self._next) % count))
        self._next = (index + 1) % count
        return index
