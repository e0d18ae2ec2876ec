"""The Whisper workers: `[listen] whisper_workers` threads per process, shared by every call's listener.

Jobs are speech segments (16 kHz float32) with a callback that runs on a worker thread when the text is
known (the listener hops it to the event loop). Jobs run in the order they were asked for; a newer
partial of a segment replaces the older one still waiting, in its place (only the latest partial
matters for "words" barge-in), and a final drops its segment's waiting partial.

Bounded, with a policy: at most `max_jobs` wait (`[listen] transcript_queue`); past it the oldest is
dropped, and a dropped final says so (`on_dropped`: the listener sends `user.transcript` with
`"dropped": true`), so a caller's transcript is late by at most the queue, never by an unbounded
backlog. A call that ends takes its jobs with it (`cancel_call`): waiting ones are removed, a running
one stops at its next Whisper segment and reports nothing. Never runs on the event loop or the engine
thread. The workers share one CTranslate2 model loaded with `num_workers` = the worker count, so
their transcriptions run in parallel.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from voicertc.listen.models import auto_workers, whisper_model

logger = logging.getLogger(__name__)

MAX_JOBS = 8


@dataclass
class TranscriptJob:
    key: tuple[str, int]  # (call id, segment number)
    pcm: np.ndarray  # 16 kHz mono float32
    final: bool
    on_text: Callable[[str], None]  # runs on a worker thread
    on_dropped: Callable[[], None] | None = None  # runs on the submitting thread; finals only


class CallCancelled(Exception):
    """The job's call ended while Whisper worked on it."""


class Transcriber:
    """Owns the Whisper worker threads over one model. `submit` and `cancel_call` are safe from any thread."""

    def __init__(self, model: Any, *, workers: int = 1, max_jobs: int = MAX_JOBS) -> None:
        self._model = model
        self._max_jobs = max_jobs
        self._cond = threading.Condition()
        self._jobs: OrderedDict[tuple[tuple[str, int], bool], TranscriptJob] = OrderedDict()
        self._running: dict[int, str] = {}  # worker thread id -> call id of its job
        self._cancelled: set[str] = set()  # calls whose running jobs must stop
        self._stopping = False
        self.dropped = 0  # finals dropped over max_jobs
        self.cancelled = 0  # jobs removed or stopped because their call ended
        self.done = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"voicertc-whisper-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def workers(self) -> int:
        return len(self._threads)

    def submit(self, job: TranscriptJob) -> None:
        dropped: list[TranscriptJob] = []
        with self._cond:
            if job.final:
                self._jobs.pop((job.key, False), None)  # the final supersedes its partial
            self._jobs[(job.key, job.final)] = job  # a partial keeps its place in the queue
            while len(self._jobs) > self._max_jobs:
                _, old = self._jobs.popitem(last=False)
                if old.final:
                    self.dropped += 1
                    dropped.append(old)
            self._cond.notify()
        for old in dropped:
            logger.warning(
                "call %s: transcript of segment %d dropped: more than %d segments wait for Whisper",
                old.key[0],
                old.key[1],
                self._max_jobs,
            )
            if old.on_dropped is not None:
                old.on_dropped()

    def cancel_call(self, call_id: str) -> None:
        """Forget `call_id`'s waiting jobs and stop its running one (its callbacks never run)."""
        with self._cond:
            for key in [k for k in self._jobs if k[0][0] == call_id]:
                del self._jobs[key]
                self.cancelled += 1
            if call_id in self._running.values():
                self._cancelled.add(call_id)

    def pending(self) -> int:
        with self._cond:
            return len(self._jobs)

    def _next(self) -> TranscriptJob | None:
        with self._cond:
            self._running.pop(threading.get_ident(), None)
            while not self._stopping and not self._jobs:
                self._cond.wait()
            if self._stopping:
                return None
            job = self._jobs.popitem(last=False)[1]
            self._running[threading.get_ident()] = job.key[0]
            return job

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                text = self.transcribe(job.pcm, job.key[0])
            except CallCancelled:
                logger.info("call %s: transcription of segment %d stopped (call ended)", *job.key)
                with self._cond:
                    self.cancelled += 1
                    self._cancelled.discard(job.key[0])
                continue
            except Exception:
                logger.exception("transcriber: segment %s failed", job.key)
                text = ""
            with self._cond:
                self.done += 1
                if job.key[0] in self._cancelled:
                    self._cancelled.discard(job.key[0])
                    continue
            try:
                job.on_text(text)
            except Exception:
                logger.exception("transcriber: callback for %s failed", job.key)

    def transcribe(self, pcm: np.ndarray, call_id: str | None = None) -> str:
        segments, _info = self._model.transcribe(
            pcm.astype(np.float32),
            language="en",
            beam_size=1,
            condition_on_previous_text=False,
            without_timestamps=True,
            vad_filter=False,
        )
        texts = []
        for segment in segments:  # lazy: Whisper decodes as this loop asks
            texts.append(segment.text.strip())
            if call_id is not None and call_id in self._cancelled:
                raise CallCancelled(call_id)
        return " ".join(texts).strip()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5.0)


_shared: dict[tuple[int, int, int], Transcriber] = {}
_shared_lock = threading.Lock()


@atexit.register
def _stop_shared() -> None:
    """Join the Whisper threads before the interpreter tears the model down under them."""
    with _shared_lock:
        for transcriber in _shared.values():
            transcriber.stop()
        _shared.clear()


def shared_transcriber(threads: int, workers: int = 1, max_jobs: int = MAX_JOBS) -> Transcriber:
    """The process's transcriber for these settings (the model is loaded by `models`)."""
    workers = auto_workers(workers)
    with _shared_lock:
        key = (threads, workers, max_jobs)
        transcriber = _shared.get(key)
        if transcriber is None:
            model = whisper_model(threads, workers)
            transcriber = _shared[key] = Transcriber(model, workers=workers, max_jobs=max_jobs)
        return transcriber
