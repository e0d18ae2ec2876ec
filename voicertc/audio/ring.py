"""A bounded PCM queue between the engine thread (writer) and the event loop (reader).

Samples are 48 kHz mono **int16** (what the track sends, so the reader never converts), kept in one
preallocated circular numpy array. Each write carries its utterance id and the generation it was
produced under; `clear()` bumps the generation so that late writes of a cancelled utterance are
dropped instead of played. End marks let the reader tell when an utterance's audio has been played.

Threads: `write`, `end_utterance`, `has_room` run on the engine thread; `read`, `clear` on the event
loop. One `threading.Lock` guards the indices and the mark queue; critical sections are array copies
of at most one piece (≤ 200 ms).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

RING_SAMPLE_RATE_HZ = 48000


class RingOverflowError(RuntimeError):
    """A write did not fit: the writer ignored `has_room()` or wrote a piece larger than the margin."""


@dataclass(frozen=True)
class Span:
    """`samples` consecutive samples of one utterance inside a read; `ended`: its end mark follows."""

    utterance_id: str
    samples: int
    ended: bool = False


@dataclass(frozen=True)
class PcmRead:
    """What one `read()` returns: the samples and, in order, which utterance each run belongs to."""

    pcm: np.ndarray  # int16 [n], n <= the samples asked for
    spans: tuple[Span, ...]


@dataclass
class _Run:
    """Queued samples of one utterance, with its end mark if it is queued too (reader-side bookkeeping)."""

    utterance_id: str
    samples: int
    ended: bool = False


class PcmRing:
    """Bounded single-producer/single-consumer ring of 48 kHz mono int16 PCM with utterance marks.

    Invariants: `0 <= queued <= capacity`; the runs in `_runs` add up to `queued` samples; whenever
    `queued >= high_water` the "was full" flag is set, so the reader calls the space listener exactly
    once when the queue drops below the high-water mark again.
    """

    def __init__(self, high_water_ms: float = 4000.0, margin_ms: float = 500.0) -> None:
        if high_water_ms <= 0 or margin_ms < 0:
            raise ValueError(
                f"PcmRing: high_water_ms must be > 0 and margin_ms >= 0, got {high_water_ms}, {margin_ms}"
            )
        self.sample_rate_hz = RING_SAMPLE_RATE_HZ
        self.high_water_samples = int(round(high_water_ms * self.sample_rate_hz / 1000))
        self.capacity_samples = self.high_water_samples + int(round(margin_ms * self.sample_rate_hz / 1000))
        self._buf = np.zeros(self.capacity_samples, dtype=np.int16)
        self._read_pos = 0  # index of the oldest queued sample
        self._queued = 0
        self._runs: deque[_Run] = deque()
        self._generation = 0
        self._was_full = False
        self._space_listener: Callable[[], None] | None = None
        self._data_listener: Callable[[], None] | None = None
        self._lock = threading.Lock()

    # --- either thread --------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def queued_samples(self) -> int:
        return self._queued

    @property
    def queued_ms(self) -> float:
        return self._queued * 1000.0 / self.sample_rate_hz

    def has_room(self) -> bool:
        """Below the high-water mark: the writer may add another piece."""
        return self._queued < self.high_water_samples

    def set_space_listener(self, callback: Callable[[], None] | None) -> None:
        """`callback()` runs on the reader's thread when the queue drops below the high-water mark."""
        self._space_listener = callback

    def set_data_listener(self, callback: Callable[[], None] | None) -> None:
        """`callback()` runs on the writer's thread when a write puts samples into an empty queue (a
        reader asleep in a long silence wakes up for them)."""
        self._data_listener = callback

    # --- writer (engine thread) -----------------------------------------------------------------

    def write(self, pcm: np.ndarray, utterance_id: str, generation: int) -> bool:
        """Queue int16 mono samples of `utterance_id`. False (dropped) if `generation` is stale."""
        pcm = np.asarray(pcm)
        if pcm.dtype != np.int16 or pcm.ndim != 1:
            raise ValueError(f"PcmRing.write wants 1-D int16 samples, got {pcm.dtype} {pcm.shape}")
        n = pcm.shape[0]
        with self._lock:
            if generation != self._generation:
                return False
            if self._queued + n > self.capacity_samples:
                raise RingOverflowError(
                    f"PcmRing overflow: {n} samples for {utterance_id!r} do not fit "
                    f"({self._queued} queued, capacity {self.capacity_samples}); write only while has_room()"
                )
            was_empty = self._queued == 0
            self._copy_in(pcm)
            self._queued += n
            self._add_run(utterance_id, n, ended=False)
            if self._queued >= self.high_water_samples:
                self._was_full = True
        if was_empty and n:
            self._notify(self._data_listener, "data")
        return True

    def end_utterance(self, utterance_id: str, generation: int) -> bool:
        """Queue the end mark of `utterance_id` after its samples. False (dropped) if stale."""
        with self._lock:
            if generation != self._generation:
                return False
            self._add_run(utterance_id, 0, ended=True)
        return True

    def _copy_in(self, pcm: np.ndarray) -> None:
        n = pcm.shape[0]
        start = (self._read_pos + self._queued) % self.capacity_samples
        first = min(n, self.capacity_samples - start)
        self._buf[start : start + first] = pcm[:first]
        self._buf[: n - first] = pcm[first:]

    def _add_run(self, utterance_id: str, samples: int, ended: bool) -> None:
        last = self._runs[-1] if self._runs else None
        if last is not None and last.utterance_id == utterance_id and not last.ended:
            last.samples += samples
            last.ended = ended
        else:
            self._runs.append(_Run(utterance_id, samples, ended))

    # --- reader (event loop) --------------------------------------------------------------------

    def read(self, max_samples: int) -> PcmRead:
        """Take up to `max_samples` of the oldest samples, and every end mark reached by them."""
        with self._lock:
            result = self._take(max_samples)
            notify = self._was_full and self._queued < self.high_water_samples
            if notify:
                self._was_full = False
        if notify:
            self._notify(self._space_listener, "space")
        return result

    def clear(self, head_samples: int = 0) -> PcmRead:
        """Drop everything queued and bump the generation; returns the first `head_samples` (to fade out).

        Writes and end marks tagged with the old generation are dropped from now on.
        """
        with self._lock:
            head = self._take(head_samples)
            self._read_pos = 0
            self._queued = 0
            self._runs.clear()
            self._generation += 1
            notify = self._was_full
            self._was_full = False
        if notify:
            self._notify(self._space_listener, "space")
        return head

    def _take(self, max_samples: int) -> PcmRead:
        n = max(0, min(max_samples, self._queued))
        end = self._read_pos + n
        if end <= self.capacity_samples:
            pcm = self._buf[self._read_pos : end].copy()
        else:
            pcm = np.concatenate((self._buf[self._read_pos :], self._buf[: end - self.capacity_samples]))
        self._read_pos = end % self.capacity_samples
        self._queued -= n
        return PcmRead(pcm, self._take_spans(n))

    def _take_spans(self, n: int) -> tuple[Span, ...]:
        spans: list[Span] = []
        while self._runs:
            run = self._runs[0]
            taken = min(n, run.samples)
            run.samples -= taken
            n -= taken
            done = run.samples == 0 and run.ended
            if taken or done:
                spans.append(Span(run.utterance_id, taken, done))
            if run.samples == 0 and (run.ended or len(self._runs) > 1):
                self._runs.popleft()
                continue
            break
        return tuple(spans)

    @staticmethod
    def _notify(listener: Callable[[], None] | None, kind: str) -> None:
        if listener is None:
            return
        try:
            listener()
        except Exception:
            logger.exception("PcmRing %s listener failed", kind)
