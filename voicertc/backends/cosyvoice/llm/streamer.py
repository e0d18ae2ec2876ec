"""The speech LLM on another executor, its tokens streamed into the engine (`[engine] llm`).

`llm = "torch"` (the default) decodes on the engine thread, batched with every other utterance
(`llm_batch.decode_batch`). With a `SpeechTokenStreamer` the engine hands each whole-text segment's
prompt (embeddings [T, H], as vLLM takes them) to the streamer and consumes what it streams back:

* `llm = "vllm"`: `vllm_runner.VllmSpeechLlm` (CUDA; the exported model, RAS as a logits processor);
* `llm = "thread"`: `ThreadedSpeechLlm`, our own torch LLM on its own thread, batching its rows on its own
  slot KV cache. It is the same seam proven on any machine, and it overlaps LLM decode with the flow
  and the vocoder of the engine thread (on a 2-core box that does not pay yet: README).

The streamer's thread calls the session's `push` (a token, None at the end, or an exception); `push`
appends to the session's inbox (a deque: one producer, one consumer) and wakes the engine worker, which
then plans a `Decode` for that utterance and takes the tokens without computing anything. Nothing
polls: the worker blocks on its queue until a push wakes it. Streaming-text utterances (deltas, the
bistream LLM) still decode on the engine thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.llm.batch import decode_batch
from voicertc.backends.cosyvoice.llm.kv import KVSlot, SlotKV
from voicertc.backends.cosyvoice.llm.qwen2lm import LlmSession, Qwen2LM
from voicertc.backends.cosyvoice.llm.sampling import SamplingMode

logger = logging.getLogger(__name__)

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
    thread would draw for the same prompt and seed. The thread sleeps on a condition while it has no rows.
    """

    def __init__(self, llm: Qwen2LM, sampling: SamplingMode = "ras", slots: int = 8, capacity: int = 512):
        self.llm = llm
        self.sampling = sampling
        self.pool = SlotKV(llm.llm.model.model, slots, capacity)  # owned by the streamer thread
        self._cond = threading.Condition()
        self._new: list[tuple[str, Tensor, int, int, TokenSink, int | None]] = []
        self._cancelled: set[str] = set()
        self._rows: dict[str, _Row] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._drive, name="llm-stream", daemon=True)
        self._thread.start()

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
        with self._cond:
            if self._stopping:
                raise RuntimeError("the LLM streamer is stopped")
            self._new.append((request_id, prompt_embeds, min_len, max_len, sink, seed))
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

    def _drive(self) -> None:
        try:
            while self._admit():
                self._step()
        except Exception:  # a bug here must not leave utterances waiting forever
            logger.exception("LLM streamer crashed")
        finally:
            for row in list(self._rows.values()):
                self._end(row, RuntimeError("the LLM streamer stopped"))

    def _admit(self) -> bool:
        """Take new requests and cancellations (sleeping while there is nothing to do); False to stop."""
        with self._cond:
            while not (self._new or self._cancelled or self._rows or self._stopping):
                self._cond.wait()
            if self._stopping:
                return False
            new, self._new = self._new, []
            cancelled, self._cancelled = self._cancelled, set()
        for request_id in cancelled:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._release(row)
        for request_id, embeds, min_len, max_len, sink, seed in new:
            if request_id in cancelled:
                continue
            try:
                self._rows[request_id] = self._open(request_id, embeds, min_len, max_len, sink, seed)
            except Exception as exc:  # noqa: BLE001 - fails that request only
                sink(exc)
        return True

    def _open(
        self, request_id: str, embeds: Tensor, min_len: int, max_len: int, sink: TokenSink, seed: int | None
    ) -> _Row:
        device = self.llm.llm_decoder.weight.device
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

    def _end(self, row: _Row, last: None | BaseException) -> None:
        self._release(row)
        row.sink(last)

    @staticmethod
    def _release(row: _Row) -> None:
        if isinstance(row.session.cache, KVSlot):
            row.session.cache.release()
