"""The speech LLM on another executor, its tokens streamed into the engine (`[engine] llm`).

`llm = "torch"` (the default) decodes on the engine thread, batched with every other utterance
(`llm_batch.decode_batch`). With a `SpeechTokenStreamer` the engine hands each whole-text segment's
prompt (embeddings [T, H], as vLLM takes them) to the streamer and consumes what it streams back:

* `llm = "vllm"`: `vllm_runner.VllmSpeechLlm` (CUDA; the exported model, RAS as a logits processor);
* `llm = "thread"`: `ThreadedSpeechLlm`, our own torch LLM on its own thread, batching its rows on its own
  slot KV cache. It is the same seam proven on any machine, and it overlaps LLM decode with the flow
  and the vocoder of the engine thread (on a 2-core box that does not pay yet: README). With
  `[engine] cuda_graphs` it decodes on its own captured decode graphs, each step launched before the
  one before is read (`llm.ahead`), on its own CUDA stream: the GPU runs the LLM's steps beside the
  engine's flow and vocoder replays instead of between them (a stream per thread; the prompt embeddings
  cross from the engine's stream behind an event).

The streamer's thread calls the session's `push` (a token, None at the end, or an exception); `push`
appends to the session's inbox (a deque: one producer, one consumer) and wakes the engine worker, which
then plans a `Decode` for that utterance and takes the tokens without computing anything. Nothing
polls: the worker blocks on its queue until a push wakes it. Streaming-text utterances (deltas, the
bistream LLM) still decode on the engine thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.llm.ahead import DROPPED, DecodeLaunch, can_launch, launch, read
from voicertc.backends.cosyvoice.llm.batch import decode_batch
from voicertc.backends.cosyvoice.llm.graphs import CpuCapture, DecodeGraphs
from voicertc.backends.cosyvoice.llm.kv import KVSlot, SlotKV
from voicertc.backends.cosyvoice.llm.qwen2lm import LlmSession, Qwen2LM
from voicertc.backends.cosyvoice.llm.sampling import SamplingMode

logger = logging.getLogger(__name__)

GRAPH_KV_CAPACITY = 2048  # positions a row with decode graphs (as the engine's: a reallocation re-captures)
StreamItem = int | None | BaseException  # a speech token, the end, or the streamer's failure
TokenSink = Callable[[StreamItem], None]


class SpeechTokenStreamer(Protocol):
    """Decodes utterances elsewhere and streams their tokens to a sink (any thread)."""

    def start(self) -> None: ...

    def submit(
        self,
        request_id: str,
        prompt_embeds: Tensor,
        min_len: int,
        max_len: int,
        sink: TokenSink,
        seed: int | None = None,
    ) -> None:
        """Start decoding `prompt_embeds` [T, H]; every token goes to `sink`, then None."""
        ...

    def cancel(self, request_id: str) -> None: ...

    def stop(self) -> None: ...


@dataclass(eq=False)
class StreamedSession:
    """The engine thread's view of one segment decoded by a streamer.

    `push` runs on the streamer's thread; everything else on the engine thread. `finished` turns True
    when the engine takes the end (or `close` cancels the request)."""

    request_id: str
    streamer: SpeechTokenStreamer
    min_len: int
    max_len: int
    wake: Callable[[], None]
    inbox: deque[StreamItem] = field(default_factory=deque)
    out_tokens: list[int] = field(default_factory=list)
    finished: bool = False
    cache: None = None  # no KV slot on the engine side

    def push(self, item: StreamItem) -> None:
        self.inbox.append(item)
        self.wake()

    def ready(self) -> bool:
        """A Decode unit can make progress now (something arrived)."""
        return bool(self.inbox)

    def take(self) -> tuple[bool, int | None]:
        """(took, token): the next token, or (True, None) at the end; (False, None) if nothing arrived.
        A streamer failure is raised here, on the engine thread, and fails this utterance only."""
        if self.finished or not self.inbox:
            return False, None
        item = self.inbox.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise RuntimeError(f"the speech LLM failed: {item}") from item
        if item is None:
            self.finished = True
            return True, None
        self.out_tokens.append(item)
        return True, item

    def close(self) -> None:
        """The utterance no longer needs this segment: cancel what the streamer still decodes."""
        if not self.finished:
            self.finished = True
            self.streamer.cancel(self.request_id)


@dataclass(eq=False)
class _Row:
    request_id: str
    session: LlmSession
    sink: TokenSink


class ThreadedSpeechLlm:
    """`llm = "thread"`: `Qwen2LM` decoding on its own thread, its rows batched on its own `SlotKV`.

    Each request samples with its own generator (seeded by `submit`), so its tokens are those the engine
    thread would draw for the same prompt and seed (with `graphs`: those of the engine's decode graphs,
    drawn on the device). The thread sleeps on a condition while it has no rows and no step in flight.

    `graphs`: True captures decode graphs over this streamer's pool on CUDA (at `start`, on the
    streamer's thread and stream, before it serves); a CPU capture (`accel.tape.TapeCapture`) runs the
    same path on a CPU (tests). A row that ends or is cancelled while a launched step still holds it
    keeps its slot until that step is read.
    """

    def __init__(
        self,
        llm: Qwen2LM,
        sampling: SamplingMode = "ras",
        slots: int = 8,
        capacity: int = 512,
        graphs: bool | CpuCapture = False,
    ):
        self.llm = llm
        self.sampling = sampling
        device = llm.llm_decoder.weight.device
        if graphs is True and device.type != "cuda":
            raise ValueError("decode graphs on the LLM streamer need a CUDA device")
        self._graph_capture = graphs
        if graphs is not False:  # the graphs' scratch row beside `slots` rows, positions never outgrown
            slots, capacity = slots + 1, max(capacity, GRAPH_KV_CAPACITY)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" and graphs is not False else None
        if self._stream is not None:  # the pool made on the stream that uses it (after what is queued)
            self._stream.wait_stream(torch.cuda.current_stream(device))
        with self._on_stream():
            self.pool = SlotKV(llm.llm.model.model, slots, capacity)  # owned by the streamer thread
        self.graphs: DecodeGraphs | None = None  # made and warmed on the streamer thread (`start`)
        self._cond = threading.Condition()
        self._new: list[tuple[str, Tensor, int, int, TokenSink, int | None, object]] = []
        self._cancelled: set[str] = set()
        self._rows: dict[str, _Row] = {}
        self._launched: DecodeLaunch | None = None  # the step in flight (graphs), read at the next step
        self._leaving: list[_Row] = []  # ended or cancelled rows whose slot a launched step still holds
        self._stopping = False
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0

    def start(self) -> None:
        """Start the streamer's thread; with graphs, return once they are captured (before ready)."""
        self._thread = threading.Thread(target=self._drive, name="llm-stream", daemon=True)
        self._thread.start()
        self._ready.wait()

    def submit(
        self,
        request_id: str,
        prompt_embeds: Tensor,
        min_len: int,
        max_len: int,
        sink: TokenSink,
        seed: int | None = None,
    ) -> None:
        if prompt_embeds.dim() != 2:
            raise ValueError(f"prompt embeddings are [T, H], got {tuple(prompt_embeds.shape)}")
        made = None  # the caller's stream made the embeddings: the streamer's waits for them
        if self._stream is not None:
            made = torch.cuda.Event()
            made.record()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the LLM streamer is stopped")
            self._new.append((request_id, prompt_embeds, min_len, max_len, sink, seed, made))
            self._cond.notify()

    def cancel(self, request_id: str) -> None:
        with self._cond:
            self._cancelled.add(request_id)
            self._cond.notify()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def active(self) -> int:
        """Requests still decoding (streamer thread's count; a snapshot from other threads)."""
        return len(self._rows)

    @property
    def rows_in_use(self) -> int:
        """Pool rows held for requests (the graphs' scratch row left out; a snapshot)."""
        scratch = self.graphs is not None and not self.graphs.scratch.released
        return self.pool.in_use - scratch

    def _drive(self) -> None:
        try:
            with self._on_stream():
                self._warm()
                while self._admit():
                    self._step()
                self._drain()
        except Exception:  # a bug here must not leave utterances waiting forever
            logger.exception("LLM streamer crashed")
        finally:
            self._ready.set()
            for row in list(self._rows.values()):
                self._end(row, RuntimeError("the LLM streamer stopped"))
            for row in self._leaving:
                self._release(row)
            if self.graphs is not None:
                self.graphs.close()

    def _on_stream(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext() if self._stream is None else torch.cuda.stream(self._stream)

    def _warm(self) -> None:
        """The decode graphs over this pool, every bucket captured now (the streamer's thread)."""
        try:
            if self._graph_capture is not False:
                rows = self.pool.slots - 1
                graphs = DecodeGraphs(self.pool, self.llm.llm_decoder, rows, capture=self._graph_capture)
                if self._graph_capture is True:
                    graphs.warm()
                self.graphs = graphs
                logger.info("LLM streamer: decode graphs of up to %d rows on its own stream", rows)
        except Exception:  # noqa: BLE001 - it decodes eagerly instead (logged)
            logger.exception("LLM streamer: decode graphs failed; decoding eagerly")
            self.graphs = None
        finally:
            self._ready.set()

    def _admit(self) -> bool:
        """Take new requests and cancellations (sleeping while there is nothing to do); False to stop."""
        with self._cond:
            while not (self._new or self._cancelled or self._rows or self._launched or self._stopping):
                self._cond.wait()
            if self._stopping:
                return False
            new, self._new = self._new, []
            cancelled, self._cancelled = self._cancelled, set()
        for request_id in cancelled:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._leave(row)
        for request_id, embeds, min_len, max_len, sink, seed, made in new:
            if request_id in cancelled:
                continue
            try:
                self._rows[request_id] = self._open(request_id, embeds, min_len, max_len, sink, seed, made)
            except Exception as exc:  # noqa: BLE001 - fails that request only
                sink(exc)
        return True

    def _open(
        self,
        request_id: str,
        embeds: Tensor,
        min_len: int,
        max_len: int,
        sink: TokenSink,
        seed: int | None,
        made: object = None,
    ) -> _Row:
        device = self.llm.llm_decoder.weight.device
        if self._stream is not None and isinstance(made, torch.cuda.Event):
            self._stream.wait_event(made)
            embeds.record_stream(self._stream)  # read here: not reused by the caller's stream before
        generator = torch.Generator(device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        slot = self.pool.acquire()
        slot.length = 0
        session = LlmSession(
            cache=slot,
            pending=embeds[None].to(device),
            min_len=min_len,
            max_len=max_len,
            sampling=self.sampling,
            generator=generator,
        )
        return _Row(request_id, session, sink)

    def _step(self) -> None:
        if self.graphs is not None:
            self._step_ahead(self.graphs)
            return
        self._release_leaving()
        if not self._rows:
            return
        rows = list(self._rows.values())
        tokens = decode_batch(self.llm, [r.session for r in rows])
        self.steps += 1
        for row, token in zip(rows, tokens, strict=True):
            if isinstance(token, BaseException):
                self._rows.pop(row.request_id, None)
                self._end(row, token)
            elif token is None:
                self._rows.pop(row.request_id, None)
                self._end(row, None)
            else:
                row.sink(token)

    def _step_ahead(self, graphs: DecodeGraphs) -> None:
        """Launch the next step of every row that can take one, then read the step launched before."""
        before, self._launched = self._launched, None
        rows = [row for row in self._rows.values() if can_launch(row.session, graphs)]
        if rows:
            try:
                self._launched = launch(self.llm, graphs, [row.session for row in rows], before)
                self.steps += 1
            except Exception as exc:  # noqa: BLE001 - the rows of this step fail together
                for row in rows:
                    self._fail(row, exc)
        if before is not None:
            self._read(before)
        self._release_leaving()

    def _read(self, step: DecodeLaunch) -> None:
        by_session = {id(row.session): row for row in [*self._rows.values(), *self._leaving]}
        try:
            tokens = read(self.llm, step)
        except Exception as exc:  # noqa: BLE001 - the rows of this step fail together
            for session in step.sessions:
                row = by_session.get(id(session))
                if row is not None and row.request_id in self._rows:
                    self._fail(row, exc)
            return
        for session, token in zip(step.sessions, tokens, strict=True):
            row = by_session.get(id(session))
            if row is None or row.request_id not in self._rows or token == DROPPED:
                continue  # cancelled, or ended at an earlier step
            if token is None or session.finished:
                if token is not None:
                    row.sink(token)  # the last one (max_len)
                self._rows.pop(row.request_id, None)
                row.sink(None)
                self._leave(row)
            else:
                row.sink(token)

    def _drain(self) -> None:
        """Stopping: read the step in flight, so no slot is released under it."""
        if self._launched is not None:
            step, self._launched = self._launched, None
            read(self.llm, step)
        self._release_leaving()

    def _fail(self, row: _Row, exc: BaseException) -> None:
        self._rows.pop(row.request_id, None)
        row.sink(exc)
        self._leave(row)

    def _leave(self, row: _Row) -> None:
        """`row` takes no more steps; its slot is released once no launched step holds it."""
        self._leaving.append(row)
        if self.graphs is None:
            self._release_leaving()

    def _release_leaving(self) -> None:
        held = {id(s) for s in self._launched.sessions} if self._launched is not None else set()
        keep = [row for row in self._leaving if id(row.session) in held]
        for row in self._leaving:
            if id(row.session) not in held:
                self._release(row)
        self._leaving = keep

    def _end(self, row: _Row, last: None | BaseException) -> None:
        self._release(row)
        row.sink(last)

    @staticmethod
    def _release(row: _Row) -> None:
        if isinstance(row.session.cache, KVSlot) and not row.session.cache.released:
            row.session.cache.release()
