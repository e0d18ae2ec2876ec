"""EngineWorker: the one thread that owns a backend and every utterance's state.

Runs on its own thread. Callers (any thread) only enqueue typed commands. The thread blocks on its
queue when nothing is runnable — with a timeout only when a backend names a time it becomes ready
(`Backend.wake_at`) — so it never polls. A failure inside one utterance becomes that utterance's
`Failed` event; the others keep going.

One loop iteration: write audio already synthesized (and finish utterances that are done), ask the
backend to `plan` the next unit of every runnable sink head, apply queued commands, let the scheduler
form one batch (`scheduler.form_batch`), and `run` it. Text intake is the worker's: pushed text lands in
`Utterance.text`, which the backend's frontend unit takes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    from voicertc.audio.decode import Clip

from voicertc.engine import voice_book
from voicertc.engine.backend import (
    AnyBackend,
    Backend,
    BatchBackend,
    StepResult,
    SynthStep,
    as_batch_backend,
)
from voicertc.engine.batch_stats import BatchStats
from voicertc.engine.delivery import Wrote
from voicertc.engine.parts import InParts, Parts
from voicertc.engine.protocol import (
    DEFAULT_OPTIONS,
    AudioSink,
    Cancel,
    Cancelled,
    Command,
    Done,
    EndInput,
    EngineEvent,
    EventCallback,
    Failed,
    OpenUtterance,
    PushText,
    RunCommand,
    SpeakOptions,
    Stop,
    Wake,
)
from voicertc.engine.scheduler import form_batch, sink_heads, urgency
from voicertc.engine.step_stats import StepStats
from voicertc.engine.utterance import Utterance
from voicertc.engine.voice_book import VoiceInfo
from voicertc.engine.work import Job, VoicePrompt, stage_name
from voicertc.errors import (
    EngineStoppedError,
    InputError,
    UnknownVoiceError,
    UtteranceTooLongError,
    VoiceRTCError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class BatchReport:
    """One batch, for metrics: its stage, size, model time, the whole iteration's time (host time =
    step_s - model_s: planning, scheduling, writing audio) and how many units were runnable."""

    stage: str
    size: int
    model_s: float
    step_s: float
    runnable: int
    cpu_s: float = 0.0  # the engine thread's CPU time in the whole iteration (not inflated by other load)


PIECE_MS = 100  # audio is written to sinks in pieces of at most this, so backpressure is fine-grained
COMMAND_PART_EVERY = 4  # while calls are urgent, a command in parts runs every 4th loop iteration
COMMAND_SLICE_SHARE = 0.25  # of max_step_ms: a command's parts per loop iteration


class EngineWorker:
    """Implements `voicertc.engine.protocol.Engine` on top of one `Backend`.

    Pass a `backend`, or a `backend_factory` to have the backend (model loading, device context) built
    on the worker thread itself; `start()` then waits until it is ready and re-raises a load error.

    Bounds: every `backend.step` is timed into `step_stats` (a step longer than `max_step_ms` is
    counted and logged once per utterance: backends cut their work so it should not happen); an
    utterance whose audio passes `max_utterance_s` is cut there and ends `Failed` (`utterance_too_long`)
    once the audio before the cut is in its sink.
    """

    def __init__(
        self,
        backend: AnyBackend | None = None,
        *,
        backend_factory: Callable[[], AnyBackend] | None = None,
        name: str = "",
        default_voice: str = "",
        max_text_chars: int = 20_000,
        max_utterances: int = 64,
        max_step_ms: float = 200.0,
        max_utterance_s: float | None = None,
        max_batch: int = 16,
        pull_tokens: int = 8,
        clock: Callable[[], float] = time.monotonic,
        observer: Callable[[BatchReport], None] | None = None,
    ) -> None:
        if (backend is None) == (backend_factory is None):
            raise ValueError("give exactly one of backend and backend_factory")
        self.backend: AnyBackend | None = backend  # set on the worker thread if lazy
        self._backend_factory = backend_factory
        self.name = name or (backend.name if backend is not None else "engine")
        self.default_voice = default_voice
        self.max_text_chars = max_text_chars
        self.max_utterances = max_utterances
        self.max_utterance_s = max_utterance_s
        self.step_stats = StepStats(max_step_ms=max_step_ms)
        self.batch_stats = BatchStats()  # batch sizes per stage, host vs model time, runnable depth
        self.max_batch = max_batch
        self.pull_tokens = pull_tokens
        self.clock = clock
        self.observer = observer  # called on the engine thread after every batch (metrics)
        self._batch_backend = as_batch_backend(backend) if backend is not None else None
        self._iteration_started = 0.0  # clock at the start of the current loop iteration
        self._iteration_cpu = 0.0  # engine-thread CPU time at that moment
        self._last_runnable = 0  # units planned in the current iteration (runnable queue depth)
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._utterances: dict[str, Utterance] = {}  # worker thread only
        self._open_ids: set[str] = set()  # opened and neither ended nor cancelled (under _count_lock)
        self._count_lock = threading.Lock()
        self._lifecycle_lock = threading.Lock()  # orders OpenUtterance before Stop in the queue
        self._accepting = False
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._commands_open = False  # the thread will still read its queue (set under _lifecycle_lock)
        self._voice_prep: ThreadPoolExecutor | None = None  # one thread: voice features off the engine
        self._command_parts: deque[tuple[Parts[Any], Future[Any]]] = deque()  # commands in parts, in order
        self._since_command_part = 0  # loop iterations since a command part last ran
        self.stats = {"utterances": 0, "done": 0, "cancelled": 0, "failed": 0}

    # --- thread-safe API -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread; blocks until the backend is ready (call it off the event loop)."""
        with self._lifecycle_lock:
            if self._thread is not None:
                return
            self._ready.clear()
            self._load_error = None
            self._commands_open = True
            self._thread = threading.Thread(target=self._run, name=f"voicertc-{self.name}", daemon=True)
            self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            self._thread.join()
            self._thread = None
            raise self._load_error
        self._accepting = True

    def stop(self, timeout_s: float = 10.0) -> None:
        """Cancel every open utterance, stop the thread, close the backend."""
        with self._lifecycle_lock:
            thread = self._thread
            if thread is None:
                return
            self._accepting = False
            self._queue.put(Stop())
            if self._voice_prep is not None:
                self._voice_prep.shutdown(wait=False, cancel_futures=True)
                self._voice_prep = None
        thread.join(timeout_s)
        if thread.is_alive():
            logger.error("engine %s did not stop within %.0f s", self.name, timeout_s)
            return
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def ready(self) -> bool:
        """Loaded, warmed up (the backend factory warms it) and accepting utterances: /readyz."""
        return self._accepting and self.running

    def supports(self, feature: str) -> bool:
        """Whether the backend honours a speak option ("instruct", "speed"); any thread."""
        return self.backend is not None and feature in self.backend.features

    @property
    def not_ready_reason(self) -> str:
        """Why `ready` is false ("" when it is true)."""
        if self.ready:
            return ""
        if self._load_error is not None:
            return f"engine {self.name} failed to load: {self._load_error}"
        if not self._ready.is_set():
            started = self._thread is not None
            return (
                f"engine {self.name} is loading and warming up"
                if started
                else f"engine {self.name} is not started"
            )
        return f"engine {self.name} has stopped"

    @property
    def retry_after_s(self) -> int:
        """A local engine that is not ready is loading or stopped: 5 s, as EngineUnavailableError says."""
        return 5

    def voices(self) -> list[str]:
        return self.backend.voices() if self._ready.is_set() and self.backend is not None else []

    def resolve_voice(self, voice: str | None) -> str:
        """The voice id to use for `voice` (None/'' = default); UnknownVoiceError names a bad one."""
        voices = self.voices()
        if not voice:
            voice = self.default_voice or (voices[0] if voices else "")
        if voice not in voices:
            raise UnknownVoiceError(f"unknown voice {voice!r}; available: {', '.join(voices) or 'none'}")
        return voice

    def open_utterance(
        self,
        voice: str | None,
        sink: AudioSink,
        on_event: EventCallback,
        utterance_id: str | None = None,
        options: SpeakOptions | None = None,
    ) -> str:
        if not self._accepting:
            raise EngineStoppedError(f"engine {self.name} is not running")
        resolved = self.resolve_voice(voice)
        uid = utterance_id or uuid.uuid4().hex[:12]
        with self._lifecycle_lock:
            if not self._accepting:
                raise EngineStoppedError(f"engine {self.name} is not running")
            with self._count_lock:
                if len(self._open_ids) >= self.max_utterances:
                    raise InputError(f"too many open utterances (limit {self.max_utterances})")
                if uid in self._open_ids:
                    raise InputError(f"utterance id {uid!r} is already open")
                self._open_ids.add(uid)
            self._queue.put(
                OpenUtterance(uid, resolved, sink, on_event, sink.generation, options or DEFAULT_OPTIONS)
            )
        return uid

    def push_text(self, utterance_id: str, text: str, end: bool = False) -> None:
        self._queue.put(PushText(utterance_id, text, end))

    def end_input(self, utterance_id: str) -> None:
        self._queue.put(EndInput(utterance_id))

    def cancel(self, utterance_id: str) -> None:
        """Queue the cancel; the utterance stops counting against the limit now, not when it is applied."""
        self._uncount(utterance_id)
        self._queue.put(Cancel(utterance_id))

    @property
    def open_count(self) -> int:
        """Open utterances (thread-safe): drops at `cancel()` time and at each terminal event."""
        with self._count_lock:
            return len(self._open_ids)

    @property
    def _open_count(self) -> int:  # the name older tests read
        return self.open_count

    def _uncount(self, utterance_id: str) -> None:
        with self._count_lock:
            self._open_ids.discard(utterance_id)

    def submit_command(self, fn: Callable[[Backend], T | InParts[T]]) -> Future[T]:
        """Run `fn(backend)` on the engine thread between steps; the future gets its result or error.

        For work that must own the backend's device and caches (voice registration, warm-up, a model
        swap). Commands run in submission order with the other commands; EngineStoppedError if the
        engine is not running (or stops before the command runs). A command that returns `InParts`
        goes on a part per loop iteration, between batches (its future resolves after its last part).
        """
        future: Future[T] = Future()
        with self._lifecycle_lock:
            if not self._commands_open or self._thread is None or not self._thread.is_alive():
                future.set_exception(EngineStoppedError(f"engine {self.name} is not running"))
                return future
            self._queue.put(RunCommand(fn, future))
        return future

    def list_voices(self) -> Future[list[VoiceInfo]]:
        return self.submit_command(voice_book.list_voices)

    def register_voice(
        self, clip: Clip, transcript: str | None, voice_id: str | None, name: str
    ) -> Future[VoiceInfo]:
        """The clip's features on the voice-preparation thread (feature extractors release the GIL; the
        transcript goes to the backend's text processes), then only the install as an engine command."""
        backend = self.backend
        if backend is None or backend.voice_book is None or not self.running:
            return self.submit_command(
                lambda b: voice_book.register_voice(b, clip, transcript, voice_id, name)
            )
        book = backend.voice_book
        answer: Future[VoiceInfo] = Future()

        def prepared(done: Future[object]) -> None:
            if answer.done():  # the caller gave up (a client that went away)
                return
            if done.cancelled():
                answer.set_exception(EngineStoppedError(f"engine {self.name} stopped"))
            elif (exc := done.exception()) is not None and not self._accepting:
                stopped = EngineStoppedError(f"engine {self.name} stopped")  # its text processes with it
                stopped.__cause__ = exc
                answer.set_exception(stopped)
            elif exc is not None:
                answer.set_exception(exc)
            else:
                features = done.result()
                _chain(self.submit_command(lambda _backend: book.install_voice(features)), answer)

        with self._lifecycle_lock:
            if self._voice_prep is None:
                self._voice_prep = ThreadPoolExecutor(
                    1, thread_name_prefix=f"voicertc-{self.name}-voice-prep"
                )
            job = self._voice_prep.submit(book.prepare_clip, clip, transcript, voice_id, name)
        job.add_done_callback(prepared)
        return answer

    def delete_voice(self, voice_id: str) -> Future[None]:
        return self.submit_command(lambda b: voice_book.delete_voice(b, voice_id))

    def wake(self) -> None:
        self._queue.put(Wake())

    def say(self, voice: str | None, sink: AudioSink, on_event: EventCallback, text: str) -> str:
        uid = self.open_utterance(voice, sink, on_event)
        self.push_text(uid, text, end=True)
        return uid

    # --- the worker thread -----------------------------------------------------------------------

    def _run(self) -> None:
        if not self._build_backend():
            return
        logger.info("engine %s started", self.name)
        running = True
        try:
            while running:
                writable, jobs = self._runnable()
                if writable or jobs or self._command_parts:
                    running = self._drain(block=False)
                    if running:
                        self._command_part(urgent=self._iterate(writable, jobs))
                else:
                    running = self._drain(block=True, timeout_s=self._idle_timeout_s())
        except Exception:
            logger.exception("engine %s worker crashed", self.name)
        finally:
            self._accepting = False
            self._teardown()

    def _build_backend(self) -> bool:
        """Build a lazy backend here, on the thread that will own it; report readiness to start()."""
        try:
            if self._backend_factory is not None:
                self.backend = self._backend_factory()
                self._batch_backend = as_batch_backend(self.backend)
            if self._batch_backend is None:
                raise EngineStoppedError(f"engine {self.name}: no backend")
            self._batch_backend.bind_wake(self.wake)  # a backend fed from another thread wakes us
            return True
        except BaseException as exc:  # noqa: BLE001 - re-raised by start() on the caller's thread
            logger.error("engine %s: backend failed to load: %s", self.name, exc)
            self._load_error = exc
            return False
        finally:
            self._ready.set()

    @property
    def _planner(self) -> BatchBackend[Any]:
        """The backend as a batch backend (worker thread; built before the loop starts)."""
        if self._batch_backend is None:
            raise RuntimeError(f"engine {self.name}: the backend is not built")
        return self._batch_backend

    def _runnable(self) -> tuple[list[Utterance], list[Job[Any]]]:
        """Sink heads with audio to write or done (no backend work), and the units the others planned."""
        now_s, writable, jobs = self.clock(), [], []
        self._iteration_started, self._iteration_cpu = now_s, time.thread_time()
        for utt in sink_heads(list(self._utterances.values())):
            try:
                if utt.held:
                    if utt.sink.has_room():
                        writable.append(utt)
                elif utt.synthesis_done:
                    writable.append(utt)
                elif utt.sink.has_room() and (work := self._planner.plan(utt, now_s)) is not None:
                    jobs.append(Job(utt, work))
            except Exception as exc:  # noqa: BLE001 - a broken sink or backend state fails only its utterance
                self._fail(utt, exc)
        self._last_runnable = len(jobs)
        return writable, jobs

    def _live(self, utt: Utterance) -> bool:
        return self._utterances.get(utt.utterance_id) is utt

    def _iterate(self, writable: list[Utterance], jobs: list[Job[Any]]) -> bool:
        """Write and finish what needs no backend, then run one batch; whether it was urgent (a call
        about to underrun or waiting for its first audio). The drain before this may have ended some
        utterances (a cancel): a released one is never written or stepped."""
        for utt in writable:
            if self._live(utt):
                self._flush(utt)
        jobs = [job for job in jobs if self._live(job.utt)]
        if not jobs:
            return False
        batch = form_batch(jobs, self.max_batch, self.pull_tokens)
        urgent = urgency(batch[0].utt)[0] < 2
        self._run_batch(batch)
        return urgent

    def _idle_timeout_s(self) -> float | None:
        wakes = []
        for utt in list(self._utterances.values()):
            try:
                if (wake_s := self._planner.wake_at(utt)) is not None:
                    wakes.append(wake_s)
            except Exception as exc:  # noqa: BLE001 - isolated per utterance
                self._fail(utt, exc)
        return max(0.0, min(wakes) - self.clock()) if wakes else None

    def _drain(self, block: bool, timeout_s: float | None = None) -> bool:
        """Apply queued commands; False once Stop arrives."""
        try:
            command = self._queue.get(block=block, timeout=timeout_s if block else None)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, Stop):
                return False
            self._apply(command)
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: Command) -> None:
        if isinstance(command, OpenUtterance):
            self._open(command)
            return
        if isinstance(command, RunCommand):
            self._run_command(command)
            return
        if isinstance(command, Wake | Stop):
            return
        utt = self._utterances.get(command.utterance_id)
        if utt is None:
            return  # already finished (e.g. cancelled by an interrupt that cleared its sink)
        if isinstance(command, PushText):
            self._push_text(utt, command.text)
            if command.end and self._live(utt):  # not failed by the push (too long)
                self._end_input(utt)
        elif isinstance(command, EndInput):
            self._end_input(utt)
        elif isinstance(command, Cancel):
            self._finish(utt, Cancelled(utt.utterance_id))

    def _run_command(self, command: RunCommand) -> None:
        if not command.future.set_running_or_notify_cancel():
            return
        try:
            result: Any = command.fn(self.backend)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            command.future.set_exception(exc)
        else:
            if isinstance(result, InParts):
                self._command_parts.append((result.parts, command.future))
            else:
                command.future.set_result(result)

    def _command_part(self, urgent: bool) -> None:
        """A slice of the oldest command in parts: parts while another fits in a quarter of
        `max_step_ms` (at least one; its future resolves after its last part). While the calls' batches
        are urgent (first audio, an underrun ahead) a slice runs only every `COMMAND_PART_EVERY`
        iterations: a registration takes the engine's slack first, yet always progresses."""
        if not self._command_parts:
            return
        self._since_command_part += 1
        if urgent and self._since_command_part < COMMAND_PART_EVERY:
            return
        self._since_command_part = 0
        parts, future = self._command_parts[0]
        slice_s = self.step_stats.max_step_ms / 1000.0 * COMMAND_SLICE_SHARE
        started = last = self.clock()
        while True:
            try:
                next(parts)
            except StopIteration as end:
                self._command_parts.popleft()
                future.set_result(end.value)
                return
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                self._command_parts.popleft()
                future.set_exception(exc)
                return
            now = self.clock()
            if 1000.0 * (now - last) > self.step_stats.max_step_ms:
                logger.warning(
                    "engine %s: a command part took %.0f ms (engine.max_step_ms = %.0f)",
                    self.name, 1000.0 * (now - last), self.step_stats.max_step_ms,
                )  # fmt: skip
            if (now - started) + (now - last) > slice_s:
                return
            last = now

    def _open(self, command: OpenUtterance) -> None:
        utt: Utterance[Any] = Utterance(
            utterance_id=command.utterance_id,
            voice=command.voice,
            sink=command.sink,
            on_event=command.on_event,
            generation=command.generation,
            opened_s=self.clock(),
            options=command.options,
        )
        self._utterances[utt.utterance_id] = utt
        self.stats["utterances"] += 1
        command.sink.set_space_listener(self.wake)
        logger.debug("utterance %s opened on voice %s", utt.utterance_id, utt.voice)
        try:
            utt.backend_state = self._planner.begin(utt)
        except Exception as exc:  # noqa: BLE001 - reported as the utterance's event
            self._fail(utt, exc)

    def _end_input(self, utt: Utterance) -> None:
        utt.input_ended = True
        if utt.first_text_s is None:
            self._fail(utt, InputError("empty text: nothing to speak"))

    def _push_text(self, utt: Utterance, text: str) -> None:
        if utt.input_ended:
            return
        utt.text_chars_total += len(text)
        if utt.text_chars_total > self.max_text_chars:
            self._fail(utt, InputError(f"text too long: more than {self.max_text_chars} characters"))
            return
        utt.note_text(text, self.clock())
        utt.text += text
        utt.metrics.setdefault("text_chars", 0.0)
        utt.metrics["text_chars"] += len(text)

    def _run_batch(self, batch: list[Job[Any]]) -> None:
        started, cpu_started = self.clock(), time.thread_time()
        for job in batch:
            if not isinstance(job.work, VoicePrompt):  # preparing a voice is not the utterance's synthesis:
                job.utt.steps += 1  # it must not count as units without audio (scheduler.AUDIO_STEPS)
        try:
            results: list[StepResult] = self._planner.run(batch, started)
        except Exception as exc:  # noqa: BLE001 - a backend that failed the whole batch fails its members
            results = [exc] * len(batch)
        model_s = self.clock() - started
        over = self.step_stats.observe(1000.0 * model_s, 1000.0 * (time.thread_time() - cpu_started))
        share_s = model_s / len(batch)
        for job, result in zip(batch, results, strict=True):
            utt = job.utt
            if not self._live(utt):
                continue
            self._observe_step(utt, share_s, model_s, over, stage_name(job.work))
            if isinstance(result, BaseException):
                self._fail(utt, result)
                continue
            try:
                self._accept(utt, result)
            except Exception as exc:  # noqa: BLE001 - isolated per utterance
                self._fail(utt, exc)
                continue
            self._flush(utt)
        self._report(batch, model_s)

    def _report(self, batch: list[Job[Any]], model_s: float) -> None:
        report = BatchReport(
            stage=stage_name(batch[0].work),
            size=len(batch),
            model_s=model_s,
            step_s=self.clock() - self._iteration_started,
            runnable=self._last_runnable,
            cpu_s=time.thread_time() - self._iteration_cpu,
        )
        self.batch_stats.observe(report.stage, report.size, report.model_s, report.step_s, report.runnable)
        if self._batch_backend is not None:
            self.batch_stats.captured = self._batch_backend.captured_counts()
        if self.observer is None:
            return
        try:
            self.observer(report)
        except Exception:
            logger.exception("engine %s: batch observer failed", self.name)

    def _flush(self, utt: Utterance) -> None:
        """Write pending audio while the sink has room; complete the utterance once all is written."""
        try:
            self._write_pending(utt)
            if self._live(utt) and utt.synthesis_done and not utt.held:
                if utt.failure is not None:
                    self._fail(utt, utt.failure)
                else:
                    self._complete(utt)
        except Exception as exc:  # noqa: BLE001 - isolated per utterance
            self._fail(utt, exc)

    def _observe_step(self, utt: Utterance, share_s: float, step_s: float, over: bool, stage: str) -> None:
        """`utt` took part in a `stage` batch step of `step_s` (its share: `share_s`); `over` = past
        max_step_ms (logged once per utterance, naming the stage)."""
        utt.add_metric("synth_s", share_s)
        step_ms = 1000.0 * step_s
        over_before = utt.metrics.get("max_step_ms", 0.0) > self.step_stats.max_step_ms
        utt.metrics["max_step_ms"] = max(utt.metrics.get("max_step_ms", 0.0), step_ms)
        if over and not over_before:
            logger.warning(
                "utterance %s: an engine step took %.0f ms (%s; engine.max_step_ms = %.0f)",
                utt.utterance_id,
                step_ms,
                stage,
                self.step_stats.max_step_ms,
            )

    def _accept(self, utt: Utterance, result: SynthStep) -> None:
        if result.text:  # before its PCM: the mark sits where this text's audio starts
            utt.hold_mark(result.text)
        if result.pcm:
            piece = max(1, result.sample_rate_hz * PIECE_MS // 1000)
            for pcm in self._capped(utt, result.pcm, result.sample_rate_hz):
                for start in range(0, len(pcm), piece):
                    utt.hold(pcm[start : start + piece], result.sample_rate_hz)
            utt.chunks += 1
            utt.longest_audio_gap_steps = max(utt.longest_audio_gap_steps, utt.steps - utt.steps_at_audio)
            utt.steps_at_audio = utt.steps
        if result.done or utt.failure is not None:
            utt.synthesis_done = True

    def _capped(self, utt: Utterance, pcm_pieces: list[np.ndarray], rate_hz: int) -> list[np.ndarray]:
        """The pieces up to `max_utterance_s` of the utterance's audio; past it, set its failure."""
        kept = []
        for pcm in pcm_pieces:
            if self.max_utterance_s is not None:
                room = max(0, round((self.max_utterance_s - utt.synth_audio_s) * rate_hz))
                if len(pcm) > room:
                    pcm = pcm[:room]
                    utt.failure = UtteranceTooLongError(
                        f"utterance too long: its audio passed limits.max_utterance_s = "
                        f"{self.max_utterance_s:g} s; the first {self.max_utterance_s:g} s are spoken"
                    )
            utt.synth_audio_s += len(pcm) / rate_hz
            if len(pcm):
                kept.append(pcm)
            if utt.failure is not None:
                break
        return kept

    def _write_pending(self, utt: Utterance) -> None:
        had_audio = utt.first_audio_s is not None
        if utt.write(lambda event: self._emit(utt, event), self.clock) is Wrote.CLEARED:
            self._finish(utt, Cancelled(utt.utterance_id))  # the sink was cleared (interrupt)
            return
        if not had_audio and (ttfa_s := utt.ttfa_s) is not None:
            utt.metrics["ttfa_s"] = ttfa_s

    def _complete(self, utt: Utterance) -> None:
        utt.end()
        synth_s = utt.metrics.get("synth_s", 0.0)
        if utt.audio_ms:
            utt.metrics["rtf"] = synth_s / (utt.audio_ms / 1000.0)
        logger.info(
            "utterance %s done: ttfa_ms=%.0f audio_ms=%.0f rtf=%.3f chunks=%d",
            utt.utterance_id,
            1000.0 * utt.metrics.get("ttfa_s", 0.0),
            utt.audio_ms,
            utt.metrics.get("rtf", 0.0),
            utt.chunks,
        )
        self._finish(utt, Done(utt.utterance_id, audio_ms=utt.audio_ms, metrics=dict(utt.metrics)))

    def _fail(self, utt: Utterance, exc: BaseException) -> None:
        if isinstance(exc, VoiceRTCError):
            code, message = exc.code, str(exc)
            logger.warning("utterance %s failed: %s", utt.utterance_id, message)
        else:
            code, message = "synthesis_error", f"{type(exc).__name__}: {exc}"
            logger.error("utterance %s failed", utt.utterance_id, exc_info=exc)
        self._finish(utt, Failed(utt.utterance_id, code, message))

    def _finish(self, utt: Utterance, event: EngineEvent) -> None:
        """Remove `utt`, free its backend state, and send its one terminal event."""
        if self._utterances.pop(utt.utterance_id, None) is None:
            return
        if isinstance(event, Done):
            utt.held.clear()
        else:
            utt.abort()
        try:
            self._planner.release(utt)
        except Exception:
            logger.exception("utterance %s: backend release failed", utt.utterance_id)
        self._uncount(utt.utterance_id)
        self.stats[{Done: "done", Cancelled: "cancelled", Failed: "failed"}[type(event)]] += 1
        self._emit(utt, event)

    def _emit(self, utt: Utterance, event: EngineEvent) -> None:
        try:
            utt.on_event(event)
        except Exception:
            logger.exception("utterance %s: event callback failed", utt.utterance_id)

    def _teardown(self) -> None:
        """Cancel open utterances and any still queued (opened before Stop), then close the backend."""
        with self._lifecycle_lock:  # a command submitted from now on is refused, not left in the queue
            self._commands_open = False
        while True:
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, RunCommand) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(EngineStoppedError(f"engine {self.name} stopped"))
            if isinstance(command, OpenUtterance):
                self._uncount(command.utterance_id)
                self.stats["cancelled"] += 1
                try:
                    command.on_event(Cancelled(command.utterance_id))
                except Exception:
                    logger.exception("utterance %s: event callback failed", command.utterance_id)
        while self._command_parts:  # commands in parts left unfinished
            parts, future = self._command_parts.popleft()
            parts.close()
            future.set_exception(EngineStoppedError(f"engine {self.name} stopped"))
        for utt in list(self._utterances.values()):
            self._finish(utt, Cancelled(utt.utterance_id))
        try:
            self._planner.close()
        except Exception:
            logger.exception("engine %s: backend close failed", self.name)
        logger.info("engine %s stopped", self.name)


def _chain(source: Future[T], target: Future[T]) -> None:
    """`target` gets `source`'s result or error when it has one."""

    def copy(done: Future[T]) -> None:
        if target.done():  # the caller gave up (a client that went away)
            return
        if done.cancelled():
            target.cancel()
        elif (exc := done.exception()) is not None:
            target.set_exception(exc)
        else:
            target.set_result(done.result())

    source.add_done_callback(copy)
