"""Text preparation (normalisation + tokenisation) off the engine thread, in a bounded process pool.

wetext's verbaliser is Python and holds the GIL for as long as it runs: 20,000 digits took 6.1 s
(English) and 8.8 s (Chinese) of CPU on the 2-core test VM, and a thread sleeping 5 ms beside it
waited up to 4.0 s / 8.0 s for the GIL (measured 2026-11-26). On the engine thread that stalls every
call; in a thread of this process it would still starve the event loop. So it runs in other processes
(`ProcessTextPrep`, `[engine] text_workers` of them, spawned once with the tokenizer and the grammars
loaded); the engine thread only installs what comes back. `InlineTextPrep` runs the same job on the
calling thread (`text_workers = 0`: tests and benchmarks that step a backend by hand).

Length caps come before any work: the engine refuses text over `[limits] max_text_chars`, and
`prep_chunks` cuts what it accepts into jobs of at most `chunk_chars` characters (at a sentence end,
else a space, else hard), so one job's time is bounded and utterances that share the pool take turns
(each has at most one job in flight). A text up to `chunk_chars` long is normalised exactly as the
official frontend does it.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from voicertc.backends.cosyvoice.voice.text import TextFrontend, text_normalize
from voicertc.engine.text_chunks import has_speech, next_text_chunk
from voicertc.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_CHARS = 1000  # one preparation job at most (a sentence end before it where there is one)


@dataclass(frozen=True)
class PreparedText:
    """A text ready for the LLM: each piece (one LLM segment when split) with its token ids."""

    pieces: tuple[tuple[str, tuple[int, ...]], ...]
    fell_back: bool = False  # the normaliser failed; the raw text was used
    cpu_s: float = 0.0  # CPU time the preparing process spent on this job
    pid: int = 0  # the process that prepared it


def prepare_text(text: str, encode: Callable[[str], Sequence[int]], split: bool) -> PreparedText:
    """The job: the official normalisation (+ split), each piece tokenised; nothing to say, no pieces."""
    import os

    started = time.process_time()
    if not has_speech(text):
        return PreparedText((), pid=os.getpid())
    fell_back = False
    try:
        pieces = text_normalize(text, encode, split=split)
    except Exception:  # noqa: BLE001 - wetext asserts on some inputs: speak the raw text instead
        pieces, fell_back = [text.strip()], True
    if not split and text[:1].isspace() and pieces and pieces[0].lstrip()[:1].isascii():
        pieces = [" " + pieces[0].lstrip(), *pieces[1:]]  # a streamed piece after a space keeps one
    encoded = tuple((p, tuple(ids)) for p in pieces if (ids := encode(p)))
    return PreparedText(encoded, fell_back, time.process_time() - started, os.getpid())


def prep_chunks(text: str, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> list[str]:
    """`text` as preparation jobs of at most `chunk_chars` characters, in order ("" gives none)."""
    chunks: list[str] = []
    rest = text
    while rest.strip():
        cut = next_text_chunk(rest, input_ended=True, first=False, max_chars=chunk_chars)
        if cut is None:  # unreachable with input_ended; keep the rest whole rather than lose it
            chunks.append(rest.strip())
            break
        chunk, rest = cut
        if chunk:
            chunks.append(chunk)
    return chunks


class TextPrep(Protocol):
    """Where preparation jobs run; `submit` never blocks on the job."""

    def submit(self, text: str, split: bool) -> Future[PreparedText]: ...

    def close(self) -> None: ...


class InlineTextPrep:
    """Runs each job at once on the calling thread (the future is done when `submit` returns)."""

    def __init__(self, encode: Callable[[str], Sequence[int]]) -> None:
        self.encode = encode

    def submit(self, text: str, split: bool) -> Future[PreparedText]:
        future: Future[PreparedText] = Future()
        try:
            future.set_result(prepare_text(text, self.encode, split))
        except Exception as exc:  # noqa: BLE001 - handed over through the future, as the pool does
            future.set_exception(exc)
        return future

    def close(self) -> None:
        pass


# ---- the pool's side: one frontend per process -------------------------------------------------------

_CHILD_FRONTEND: TextFrontend | None = None


def _child_init(frontend_class: type[TextFrontend], blanken_dir: str) -> None:
    global _CHILD_FRONTEND
    _CHILD_FRONTEND = frontend_class(blanken_dir)
    prepare_text("warm up 1.", _CHILD_FRONTEND.encode, split=True)  # tokenizer + grammars loaded now


def _child_prepare(text: str, split: bool) -> PreparedText:
    if _CHILD_FRONTEND is None:
        raise RuntimeError("text preparation process not initialised")
    return prepare_text(text, _CHILD_FRONTEND.encode, split)


class ProcessTextPrep:
    """`workers` spawned processes, each with its own tokenizer and normaliser; a pool that broke (a
    process killed) is rebuilt at the next job."""

    def __init__(self, frontend: TextFrontend, workers: int = 1) -> None:
        self.frontend_class = type(frontend)
        self.blanken_dir = str(Path(frontend.blanken_dir))
        self.workers = max(1, workers)
        self._lock = threading.Lock()
        self._pool = self._new_pool()
        try:
            self.submit("warm up.", split=True).result()  # the processes are up before the engine is ready
        except BrokenProcessPool as exc:
            self.close()
            raise ConfigError(
                "engine.text_workers: the text processes could not start (a script that builds the engine "
                "needs an `if __name__ == '__main__':` guard, as Python's spawn requires; or set 0)"
            ) from exc

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            self.workers,
            mp_context=multiprocessing.get_context("spawn"),  # never fork a process holding torch threads
            initializer=_child_init,
            initargs=(self.frontend_class, self.blanken_dir),
        )

    def submit(self, text: str, split: bool) -> Future[PreparedText]:
        with self._lock:
            try:
                return self._pool.submit(_child_prepare, text, split)
            except BrokenProcessPool:
                logger.warning("text preparation pool broke; starting it again")
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool()
                return self._pool.submit(_child_prepare, text, split)

    def close(self) -> None:
        """Queued jobs cancelled and the processes ended now: one busy with a long text is not waited for
        (its job fails with BrokenProcessPool; text preparation holds nothing worth finishing)."""
        with self._lock:
            processes = list((getattr(self._pool, "_processes", None) or {}).values())
            self._pool.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.terminate()
            logger.debug("text preparation: %d process(es) ended", len(processes))


def text_prep_for(frontend: TextFrontend, workers: int) -> TextPrep:
    """`[engine] text_workers`: 0 = on the calling thread, else that many processes."""
    return ProcessTextPrep(frontend, workers) if workers > 0 else InlineTextPrep(frontend.encode)
