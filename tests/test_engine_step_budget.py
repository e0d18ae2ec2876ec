"""The worker cuts batches to the step budget (`[engine] step_budget_batches`) from the costs it
measured, with an injected clock: a backend whose batches cost 55 ms per row is run in batches that fit
200 ms once a first batch was measured; one whose cost is fixed keeps its full batches."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from engine_helpers import EventLog, RecordingSink

from voicertc.engine import Done
from voicertc.engine.backend import StepResult, SynthStep
from voicertc.engine.utterance import Utterance
from voicertc.engine.work import Decode, Job, Work
from voicertc.engine.worker import EngineWorker

STEPS = 6  # units per utterance


class CostedBackend:
    """Every utterance needs STEPS batched units; a batch of r rows advances the clock by cost(r)."""

    name = "costed"

    def __init__(self, fixed_ms: float, per_row_ms: float) -> None:
        self.fixed_ms, self.per_row_ms = fixed_ms, per_row_ms
        self.now_s = 0.0
        self.batches: list[int] = []

    def clock(self) -> float:
        return self.now_s

    def voices(self) -> list[str]:
        return ["v"]

    def begin(self, utt: Utterance) -> int:
        return STEPS

    def plan(self, utt: Utterance, now_s: float) -> Work | None:
        return Decode() if utt.backend_state else None

    def run(self, batch: Sequence[Job], now_s: float) -> list[StepResult]:
        self.batches.append(len(batch))
        self.now_s += (self.fixed_ms + self.per_row_ms * len(batch)) / 1000.0
        out: list[StepResult] = []
        for job in batch:
            job.utt.backend_state -= 1
            out.append(SynthStep([np.zeros(240, np.float32)], 24000, done=job.utt.backend_state == 0))
        return out

    def wake_at(self, utt: Utterance) -> float | None:
        return None

    def release(self, utt: Utterance) -> None:
        utt.backend_state = None

    def close(self) -> None:
        pass


def _run(backend: CostedBackend, budget: bool, utterances: int = 12) -> list[int]:
    engine = EngineWorker(
        backend, max_batch=16, max_step_ms=200.0, step_budget_batches=budget, clock=backend.clock
    )
    engine.start()
    log, sinks, ids = EventLog(), {}, []
    try:
        for i in range(utterances):
            uid = f"u{i}"
            sinks[uid] = RecordingSink()
            engine.open_utterance("v", sinks[uid], log, utterance_id=uid)
            ids.append(uid)
        for uid in ids:
            engine.push_text(uid, "hello")
            engine.end_input(uid)
        log.wait_terminal(ids, timeout_s=30)
    finally:
        engine.stop()
    assert all(isinstance(log.of(uid)[-1], Done) for uid in ids)
    return backend.batches


def test_per_row_costs_are_cut_to_the_budget():
    batches = _run(CostedBackend(fixed_ms=5.0, per_row_ms=55.0), budget=True)
    assert sum(batches) == 12 * STEPS
    # the first batch is measured (all 12 were runnable), then at most 3 rows (3 x 55 <= 200)
    assert batches[0] == 12 and max(batches[1:]) == 3


def test_fixed_costs_keep_full_batches():
    batches = _run(CostedBackend(fixed_ms=400.0, per_row_ms=2.0), budget=True)
    assert sum(batches) == 12 * STEPS
    # one cautious cut batch gives the fit its second point; the small per-row price keeps batching
    assert batches[0] == 12 and sum(b < 12 for b in batches[:-1]) == 1


def test_off_runs_whatever_is_runnable():
    batches = _run(CostedBackend(fixed_ms=5.0, per_row_ms=55.0), budget=False)
    assert sum(batches) == 12 * STEPS
    assert batches == [12] * STEPS
