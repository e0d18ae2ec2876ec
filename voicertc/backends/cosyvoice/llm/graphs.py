"""The batched one-position LLM decode step at static shapes, captured as one CUDA graph per batch bucket.

`[engine] cuda_graphs = true` (CUDA only). A decode step of B rows on a `SlotKV` is padded to the
smallest bucket >= B (1, 2, 4, ... up to `max_rows`); the pad rows write into a scratch row of the pool
that no utterance owns. Every row attends over a span of positions (masked to its own length): the
smallest of `span_quantum`, twice that, ... that holds every row's next position, at most the pool's
capacity, so a step's shapes depend on its (rows, span) bucket alone: the graph of that bucket, captured
once, replays it with a few host->device copies and no kernel launches from Python. The span follows
the rows' lengths, not the capacity: a decode step's attention is one query against every key of its
span (a handful of thread blocks walking the keys on a GPU), and the engine's capacity of 2,048
positions made every step of a short utterance walk all of them. A pool that grows (more slots, more
positions) reallocates its K/V tensors and the graphs are captured again.

On a CPU the same padded static step runs eagerly (no capture), or recorded once and replayed from its
ops (`capture=TapeCapture()`, `accel.tape`: what a CUDA graph does), which is what the CPU tests check
against `SlotKV.forward`; on CUDA the gpu tests check that replay gives the eager tokens.

`compile=True` (`[engine] compile` with `cuda_graphs`) runs the static step through `torch.compile`
(inductor) before it is captured: the ~20 small kernels a layer (norms, rotary, the residual adds, the
gated activation, the cache writes) become a few fused ones, and the capture replays those. One
compile for one row and one for every larger bucket (the batch dimension, the pool's slots and
positions and the span are symbolic), both at warm-up; after it (`seal`) a step that would compile again runs
uncompiled (`accel.compiled.call_sealed`), counted. A CPU compiles it to C++ the same way (what the CPU
tests check).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from voicertc.backends.cosyvoice.accel.compiled import call_sealed, compiled_step
from voicertc.backends.cosyvoice.accel.staging import staged
from voicertc.backends.cosyvoice.llm.kv import KVSlot, SlotKV

logger = logging.getLogger(__name__)

# a CPU stand-in for a capture: a step in, its replay out (`accel.tape.TapeCapture`)
CpuCapture = Callable[[Callable[[], tuple[Tensor, ...]]], Callable[[], tuple[Tensor, ...]]]

# every capture of the wing (decode graphs here, the flow and HiFT steps in accel/captured.py): another
# thread's CUDA work during a capture (the threaded LLM's decode) neither invalidates it nor fails in
# that thread ("global", torch's default, forbids it process-wide)
CAPTURE_ERROR_MODE = "thread_local"
# one side stream per device and thread for every capture and its warm-up runs: `torch.cuda.Stream()`
# hands out a pool of 32 streams in turn, so a stream asked for at every capture would soon be the
# LLM streamer's or the engine lane's own, and one thread's capture would swallow the other's work
_capture_streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}
# one capture at a time in the process: a capture starts with a device-wide sync, which would break
# another thread's capture in progress
_capture_lock = threading.Lock()
_abandoned: list[torch.cuda.CUDAGraph] = []  # failed captures, kept alive (the allocator may point at them)


def capture_stream() -> torch.cuda.Stream:
    """The calling thread's side stream on the current device (captures and their warm-up runs)."""
    device = torch.device("cuda", torch.cuda.current_device())
    key = (device, threading.get_ident())
    stream = _capture_streams.get(key)
    if stream is None:
        stream = _capture_streams[key] = torch.cuda.Stream(device)
    return stream


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: Any) -> Iterator[None]:
    """Capture the CUDA work of the block into `graph` (its memory from `pool`): `torch.cuda.graph`
    without the cache flushes it starts with. That context empties torch's device and pinned-host
    caches before every capture (memory for the graph); a bucket captured while calls speak (a history
    past the warmed keys, a decode pool that grew) then sends every later allocation back to the
    driver, each cudaMalloc / cudaHostAlloc slow and the frees synchronising the device. The graphs
    here share a private pool and the warm-up sizes the memory budget, so nothing is flushed. A capture
    that fails gives the allocator its pool back (`_abandon`) and raises the block's own error; the
    caller takes a new pool for the next capture."""
    stream = capture_stream()
    with _capture_lock:
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode=CAPTURE_ERROR_MODE)
            try:
                yield
            except BaseException:
                _abandon(graph)
                raise
            try:
                graph.capture_end()
            except BaseException:
                _abandon(graph, ended=True)
                raise


def _abandon(graph: torch.cuda.CUDAGraph, ended: bool = False) -> None:
    """End a failed capture: `capture_end` raises before it ends the allocator's routing of the stream's
    allocations into the graph's pool when the capture was invalidated (then freed blocks would never
    be reused again, and the pool could not be captured into again)."""
    if not ended:
        try:
            graph.capture_end()
            return  # the capture itself ended cleanly
        except RuntimeError:
            pass
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), graph.pool())
    except RuntimeError:  # it had ended it already
        pass
    _abandoned.append(graph)


def batch_buckets(max_rows: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two >= max_rows."""
    buckets = [1]
    while buckets[-1] < max_rows:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `rows` rows (None: more rows than the largest bucket)."""
    return next((b for b in buckets if b >= rows), None)


SPAN_QUANTUM = 256  # the shortest key span a step attends over (positions)
PROMPT_TOKENS = (32, 64, 128, 256)  # a prompt step's padded positions; longer prompts are fed eagerly
# captured at warm-up: prompt steps of every row bucket up to 64 positions (a voice's cached prefix
# leaves an utterance's own text, tens of positions), and up to 8 rows of 128 (an uncached prompt)
WARM_PROMPT_TOKENS, WARM_LONG_PROMPT_ROWS = 64, 8


def span_for(positions: int, quantum: int, capacity: int) -> int:
    """The key span of a step whose rows need `positions` positions: `quantum` doubling until it holds
    them, at most `capacity` (the pool has grown to hold them). Pure."""
    span = quantum
    while span < positions:
        span *= 2
    return min(span, capacity)


def spans_up_to(quantum: int, capacity: int) -> list[int]:
    """Every span a pool of `capacity` positions meets."""
    spans = [min(quantum, capacity)]
    while spans[-1] < capacity:
        spans.append(min(2 * spans[-1], capacity))
    return spans


@dataclass(eq=False)
class StaticStep:
    """One bucket's fixed input/output buffers (and its captured graph, on CUDA)."""

    rows: int
    span: int  # key positions every row attends over ([0, span), masked to its own length)
    index: Tensor  # [rows] pool row of each batch row
    positions: Tensor  # [rows, 1] the position each row writes
    embeds: Tensor  # [rows, 1, H]
    key_positions: Tensor  # [span]: the span as a tensor's length (a symbol of the compiled step)
    last: Tensor | None = None  # a prompt step's: [rows] each row's last real position in `embeds`
    logits: Tensor | None = None  # [rows, V] (written by the step)
    graph: torch.cuda.CUDAGraph | None = None
    recorded: Callable[[], tuple[Tensor, ...]] | None = None  # the CPU stand-in's replay (`accel.tape`)
    compiled: bool = False  # runs the compiled step (else the uncompiled one)


class DecodeGraphs:
    """Static-shape decode steps over `pool`, one per bucket; engine thread only."""

    def __init__(
        self,
        pool: SlotKV,
        head: nn.Module,
        max_rows: int,
        capture: bool | CpuCapture | None = None,
        compile: bool = False,
        span_quantum: int = SPAN_QUANTUM,
    ) -> None:
        self.pool = pool
        self.head = head  # hidden [B, H] -> logits [B, V] (`llm_decoder`)
        self.buckets = batch_buckets(max_rows)
        self.span_quantum = span_quantum
        # a CPU stand-in for the capture (`accel.tape.TapeCapture`: each step recorded once, replayed)
        self.cpu_capture = None if isinstance(capture, bool | None) else capture
        if self.cpu_capture is not None and compile:
            raise ValueError("a compiled step cannot be recorded on a CPU")
        self.capture = pool.device.type == "cuda" if capture is None else capture is True
        if self.capture and pool.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA pool")
        self.scratch = pool.acquire()  # the pad rows' row: owned by no utterance
        self.hidden_size = int(pool.backbone.config.hidden_size)
        self._steps: dict[tuple[int, int], StaticStep] = {}  # by (rows, span)
        self._prompts: dict[tuple[int, int, int], StaticStep] = {}  # by (rows, positions, span)
        self.prompt_eager = 0  # prompts longer than every prompt step, fed eagerly
        self._generation = pool.generation
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self.captures = 0  # decode steps' (prompt steps': `prompt_captures`)
        self.replays = 0
        self.prompt_captures = 0
        self.prompt_replays = 0
        self.uncompiled = 0  # steps made after warm-up that run uncompiled (compiling again refused)
        self.compiled = compile
        self.sealed = False
        self._static_step: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] = self._static_logits
        if compile:  # the batch dimension marked dynamic per bucket (`_step`), the rest static
            self._static_step = compiled_step(self._static_logits, dynamic=None)

    def close(self) -> None:
        self._steps.clear()
        self._prompts.clear()
        self.scratch.release()

    def warm(self) -> None:
        """Capture every (rows, span) bucket now (at start-up, not during the first calls)."""
        spans = spans_up_to(self.span_quantum, self.pool.capacity)
        for rows in self.buckets:
            for span in spans:
                self._step(rows, span)
        for rows in self.buckets:
            longest = 128 if rows <= WARM_LONG_PROMPT_ROWS else WARM_PROMPT_TOKENS
            for tokens in (t for t in PROMPT_TOKENS if t <= longest):
                for span in (s for s in spans if s >= tokens):
                    self._prompt_step(rows, tokens, span)

    def seal(self) -> None:
        """Warm-up is over: a step made from now on (a grown pool's) never compiles again."""
        self.sealed = True

    @torch.inference_mode()
    def logits(self, rows: list[KVSlot], embeds: Tensor) -> Tensor:
        """Logits [B, V] of one position for each row (`embeds` [B, 1, H]); each row's length grows by 1.

        More rows than the largest bucket run the eager `SlotKV.forward`."""
        if embeds.shape[1] != 1 or len(rows) != embeds.shape[0]:
            raise ValueError(f"a static step takes [B, 1, H] for B rows, got {tuple(embeds.shape)}")
        if any(r.released or r.pool is not self.pool for r in rows):
            raise ValueError("a released or foreign KV slot")
        bucket = bucket_for(len(rows), self.buckets)
        if bucket is None:
            return self.head(self.pool.forward(rows, embeds)[:, -1])
        self._room(max(r.length for r in rows) + 1)
        span = span_for(max(r.length for r in rows) + 1, self.span_quantum, self.pool.capacity)
        step = self._step(bucket, span)
        pad = bucket - len(rows)
        index = [r.index for r in rows] + [self.scratch.index] * pad
        positions = [r.length for r in rows] + [0] * pad
        step.index.copy_(self._staged(index), non_blocking=True)
        step.positions.copy_(self._staged(positions)[:, None], non_blocking=True)
        step.embeds[: len(rows)].copy_(embeds)
        step.embeds[len(rows) :].zero_()
        self._replay(step)
        for r in rows:
            r.length += 1
        assert step.logits is not None
        return step.logits[: len(rows)].clone()

    @torch.inference_mode()
    def prompt_logits(self, rows: list[KVSlot], embeds: list[Tensor]) -> Tensor | None:
        """Logits [B, V] of each row's last prompt position, the prompts `embeds` ([1, T_b, H] each) fed
        as one replay of a (rows, positions, span) prompt step: right-padded to a `PROMPT_TOKENS` bucket
        (the pad positions' K/V lie past each row's length, where attention is causal: never seen,
        overwritten by the next step; `SlotKV.forward_ragged` relies on the same) and rows to a batch
        bucket. Each row's length grows by its own T_b. None: a prompt longer than every bucket, more
        rows than the largest, or padding past the pool's capacity (the caller feeds it eagerly, growing
        the pool if it must; counted in `prompt_eager`)."""
        longest = max(e.shape[1] for e in embeds)
        tokens = next((t for t in PROMPT_TOKENS if t >= longest), None)
        bucket = bucket_for(len(rows), self.buckets)
        if tokens is None or bucket is None:
            self.prompt_eager += 1
            return None
        if any(r.released or r.pool is not self.pool for r in rows):
            raise ValueError("a released or foreign KV slot")
        needed = max(r.length for r in rows) + tokens
        if needed > self.pool.capacity:  # the padding alone must not grow the pool (every graph again)
            self.prompt_eager += 1
            return None
        self._room(needed)
        step = self._prompt_step(bucket, tokens, span_for(needed, self.span_quantum, self.pool.capacity))
        assert step.last is not None
        pad = bucket - len(rows)
        starts = [r.length for r in rows] + [0] * pad
        step.index.copy_(
            self._staged([r.index for r in rows] + [self.scratch.index] * pad), non_blocking=True
        )
        step.positions.copy_(
            self._staged([[p + t for t in range(tokens)] for p in starts]), non_blocking=True
        )
        step.last.copy_(self._staged([e.shape[1] - 1 for e in embeds] + [0] * pad), non_blocking=True)
        step.embeds.zero_()
        for b, e in enumerate(embeds):
            step.embeds[b, : e.shape[1]].copy_(e[0])
        self._replay(step)
        for r, e in zip(rows, embeds, strict=True):
            r.length += e.shape[1]
        assert step.logits is not None
        return step.logits[: len(rows)].clone()

    def _staged(self, values: list[int] | list[list[int]]) -> Tensor:
        """Host ints to copy into a step's inputs without a stream sync (`accel.staging`: the launches
        of `llm.ahead` must not wait for the step in flight)."""
        return staged(torch.tensor(values, dtype=torch.long), self.pool.device)

    def _room(self, positions: int) -> None:
        """Room for `positions` positions a row; a pool that reallocated its K/V drops every graph."""
        self.pool.ensure_capacity(positions)
        if self.pool.generation != self._generation:  # K/V reallocated: captured addresses are stale
            logger.info("LLM slot cache reallocated: decode graphs are captured again")
            self._steps.clear()
            self._prompts.clear()
            self._generation = self.pool.generation
            if self.capture:  # the old graphs' private memory pool dies with them: a new one
                self._mempool = torch.cuda.graph_pool_handle()

    def _forward(self, step: StaticStep) -> Tensor:
        if step.last is not None:
            return self._static_prompt(step.index, step.positions, step.embeds, step.key_positions, step.last)
        fn = self._static_step if step.compiled else self._static_logits
        return fn(step.index, step.positions, step.embeds, step.key_positions)

    def _static_prompt(
        self, index: Tensor, positions: Tensor, embeds: Tensor, key_positions: Tensor, last: Tensor
    ) -> Tensor:
        hidden = self.pool.run(index, positions, embeds, key_positions.shape[0])  # [B, T, H]
        picked = hidden.gather(1, last[:, None, None].expand(-1, 1, hidden.shape[2]))
        return self.head(picked[:, 0])

    def _static_logits(
        self, index: Tensor, positions: Tensor, embeds: Tensor, key_positions: Tensor
    ) -> Tensor:
        hidden = self.pool.run(index, positions, embeds, key_positions.shape[0])
        return self.head(hidden[:, -1])

    def _replay(self, step: StaticStep) -> None:
        if step.last is None:
            self.replays += 1
        else:
            self.prompt_replays += 1
        if step.graph is not None:
            step.graph.replay()
        elif step.recorded is not None:
            step.logits = step.recorded()[0]
        else:
            step.logits = self._forward(step)

    def _step(self, rows: int, span: int) -> StaticStep:
        step = self._steps.get((rows, span))
        if step is not None:
            return step
        device, dtype = self.pool.device, self.pool.dtype
        with torch.inference_mode(False):  # ordinary tensors, at warm-up or not (a compile guards on it)
            step = StaticStep(
                rows=rows,
                span=span,
                index=torch.full((rows,), self.scratch.index, dtype=torch.long, device=device),
                positions=torch.zeros((rows, 1), dtype=torch.long, device=device),
                embeds=torch.zeros((rows, 1, self.hidden_size), dtype=dtype, device=device),
                key_positions=torch.arange(span, device=device),
            )
        if self.compiled:  # buckets of 2+ rows share one compile (0/1-sized dims are specialised)
            for t in (step.index, step.positions, step.embeds, step.key_positions):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            self._mark_pool_dynamic()
            step.compiled = self._compiles_within_seal(step)
        if self.capture:
            self._capture(step)
        elif self.compiled:  # compile now (warm-up), not in the first call's step
            self._timed_compile(step)
        elif self.cpu_capture is not None:
            self._record(step)
        self._steps[(rows, span)] = step
        return step

    def _prompt_step(self, rows: int, tokens: int, span: int) -> StaticStep:
        """The (rows, positions, span) prompt step, made (and captured on CUDA) on first use; never
        compiled (a prompt is once per segment, its positions would be one more symbol)."""
        step = self._prompts.get((rows, tokens, span))
        if step is not None:
            return step
        device, dtype = self.pool.device, self.pool.dtype
        with torch.inference_mode(False):
            step = StaticStep(
                rows=rows,
                span=span,
                index=torch.full((rows,), self.scratch.index, dtype=torch.long, device=device),
                positions=torch.arange(tokens, device=device).expand(rows, tokens).contiguous(),
                embeds=torch.zeros((rows, tokens, self.hidden_size), dtype=dtype, device=device),
                key_positions=torch.arange(span, device=device),
                last=torch.zeros((rows,), dtype=torch.long, device=device),
            )
        if self.capture:
            self._capture(step)
        elif self.cpu_capture is not None:
            self._record(step)
        self._prompts[(rows, tokens, span)] = step
        return step

    @torch.inference_mode()
    def _compiles_within_seal(self, step: StaticStep) -> bool:
        """Whether `step` runs the compiled step: always before `seal`; after it only if that needs
        no compile (a probe on the step's pad inputs, which write only the scratch row)."""
        if not self.sealed:
            return True
        inputs = (step.index, step.positions, step.embeds, step.key_positions)
        _, compiled = call_sealed(self._static_step, self._static_logits, *inputs)
        self.uncompiled += not compiled
        return compiled

    def _mark_pool_dynamic(self) -> None:
        """The pool's slots and positions as symbols of the compiled step: a pool that grows while
        calls speak is captured again (milliseconds), not compiled again (a minute on the engine
        thread)."""
        for t in (*self.pool.keys, *self.pool.values):
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 2)

    @torch.inference_mode()
    def _timed_compile(self, step: StaticStep) -> None:
        start = time.perf_counter()
        self._forward(step)
        if step.compiled:
            logger.info("decode step of %d rows compiled in %.1f s", step.rows, time.perf_counter() - start)

    @torch.inference_mode()
    def _record(self, step: StaticStep) -> None:
        """The CPU stand-in of `_capture` (the pad inputs write only the scratch row)."""
        assert self.cpu_capture is not None
        step.recorded = self.cpu_capture(lambda: (self._forward(step),))

    @torch.inference_mode()
    def _capture(self, step: StaticStep) -> None:
        """Warm up on a side stream (the pad inputs write only the scratch row), then capture."""
        side = capture_stream()
        side.wait_stream(torch.cuda.current_stream())
        start = time.perf_counter()
        with torch.cuda.stream(side):  # (a compiled step compiles and autotunes in the first call)
            for _ in range(2):
                self._forward(step)
        torch.cuda.current_stream().wait_stream(side)
        warm_s = time.perf_counter() - start
        graph = torch.cuda.CUDAGraph()
        try:
            with capturing(graph, self._mempool):
                step.logits = self._forward(step)
        except Exception:
            self._mempool = torch.cuda.graph_pool_handle()  # the failed capture's pool is not reused
            raise
        step.graph = graph
        if step.last is None:
            self.captures += 1
        else:
            self.prompt_captures += 1
        logger.info(
            "captured the %s graph of %d rows over %d positions (capacity %d; %s, warm-up %.1f s)",
            "decode" if step.last is None else f"{step.embeds.shape[1]}-position prompt",
            step.rows,
            step.span,
            self.pool.capacity,
            "compiled" if step.compiled else "eager kernels",
            warm_s,
        )
