"""The Whisper worker thread: one per process, shared by every call's listener.

Jobs are speech segments (16 kHz float32) with a callback that runs on this thread when the text is
known (the listener hops it to the event loop). Jobs run in the order they were asked for; a newer
partial of a segment replaces the older one still waiting, in its place (only the latest partial
matters for "words" barge-in), and a final drops its segment's waiting partial. At most `max_jobs`
wait (oldest dropped and counted). Never runs on the event loop or the engine thread.
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

logger = logging.getLogger(__name__)

MAX_JOBS = 64


@dataclass
class TranscriptJob:
    key: tuple[str, int]  # (call id, segment number)
    pcm: np.ndarray  # 16 kHz mono float32
    final: bool
    on_text: Callable[[str], None]  # runs on the transcriber thread


class Transcriber:
    """Owns one Whisper model and one thread. `submit` is safe from any thread."""

    def __init__(self, model: Any, *, max_jobs: int = MAX_JOBS) -> None:
        self._model = model
        self._max_jobs = max_jobs
        self._cond = threading.Condition()
        self._jobs: OrderedDict[tuple[tuple[str, int], bool], TranscriptJob] = OrderedDict()
        self._stopping = False
        self.dropped = 0
        self.done = 0
        self._thread = threading.Thread(target=self._run, name="voicertc-whisper", daemon=True)
        self._thread.start()

    def submit(self, job: TranscriptJob) -> None:
        with self._cond:
            if job.final:
                self._jobs.pop((job.key, False), None)  # the final supersedes its partial
            self._jobs[(job.key, job.final)] = job  # a partial keeps its place in the queue
            while len(self._jobs) > self._max_jobs:
                self._jobs.popitem(last=False)
                self.dropped += 1
                logger.warning(
                    "transcriber: more than %d segments waiting; dropped the oldest", self._max_jobs
                )
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._jobs)

    def _next(self) -> TranscriptJob | None:
        with self._cond:
            while not self._stopping and not self._jobs:
                self._cond.wait()
            if self._stopping:
                return None
            return self._jobs.popitem(last=False)[1]

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                text = self.transcribe(job.pcm)
            except Exception:
                logger.exception("transcriber: segment %s failed", job.key)
                text = ""
            self.done += 1
            try:
                job.on_text(text)
            except Exception:
                logger.exception("transcriber: callback for %s failed", job.key)

    def transcribe(self, pcm: np.ndarray) -> str:
        segments, _info = self._model.transcribe(
            pcm.astype(np.float32),
            language="en",
            beam_size=1,
            condition_on_previous_text=False,
            without_timestamps=True,
            vad_filter=False,
        )
        return " ".join(s.text.strip() for s in segments).strip()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=5.0)


_shared: dict[int, Transcriber] = {}
_shared_lock = threading.Lock()


@atexit.register
def _stop_shared() -> None:
    """Join the Whisper thread before the interpreter tears the model down under it."""
    with _shared_lock:
        for transcriber in _shared.values():
            transcriber.stop()
        _shared.clear()


def shared_transcriber(threads: int) -> Transcriber:
    """The process's transcriber for this thread count (the model is loaded by `models`)."""
    from voicertc.listen.models import whisper_model

    with _shared_lock:
        transcriber = _shared.get(threads)
        if transcriber is None:
            transcriber = _shared[threads] = Transcriber(whisper_model(threads))
        return transcriber
