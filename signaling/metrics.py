"""A tiny Prometheus text-format registry: the few counters, gauges and one histogram voicertc exports.

Owned by the event loop (no locks): every update happens on the loop thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from voicertc.engine.batch_stats import BATCH_SIZE_BUCKETS, BatchStats
from voicertc.engine.step_stats import StepStats

Sample = tuple[dict[str, str], float]  # (labels, value) of one Prometheus sample

CALL_COUNTERS = {
    "utterances": "Utterances requested.",
    "interrupts": "Interrupts (barge-ins) that cut an utterance.",
    "underrun_frames": "Frames of a playing utterance not sent on time (silence, or skipped by a re-anchor).",
    "late_frames": "Frames sent more than one frame after their due time (engine, event loop or CPU behind).",
    "gaps_over_100ms": "Pauses of more than 100 ms between two frames sent.",
    "frames_sent": "Audio frames sent.",
    "dtx_frames": "Silent audio frames not sent ([webrtc] dtx): their time passed with no packet.",
    "barge_ins": "Utterances cut because the caller spoke ([listen] barge_in).",
    "user_speech_segments": "Caller speech segments detected (user.speech.started).",
    "inbound_dropped_frames": "16 kHz microphone frames dropped because a reader fell behind.",
}
TTFA_BUCKETS_S = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


@dataclass
class Histogram:
    buckets_s: tuple[float, ...] = TTFA_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: int = 0
    sum_s: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets_s)

    def observe(self, value_s: float) -> None:
        self.total += 1
        self.sum_s += value_s
        for i, bound in enumerate(self.buckets_s):
            if value_s <= bound:
                self.counts[i] += 1


@dataclass
class Metrics:
    """Process-wide numbers for /metrics. `active_calls` and the underrun total are read through callbacks."""

    calls_total: int = 0
    errors_total: dict[str, int] = field(default_factory=dict)  # error events sent to clients, by code
    http_errors_total: dict[int, int] = field(default_factory=dict)  # HTTP 4xx/5xx answers, by status
    ttfa: Histogram = field(default_factory=Histogram)
    engine_rtf: Histogram = field(default_factory=lambda: Histogram(RTF_BUCKETS))
    engine_stage_s: dict[str, float] = field(default_factory=dict)  # seconds per engine stage, summed
    closed_calls: dict[str, int] = field(default_factory=dict)  # per-call counters of calls already closed
    active_calls: Callable[[], int] = lambda: 0
    live_calls: Callable[[], dict[str, int]] = lambda: {}  # the same counters summed over open calls
    engine_steps: Callable[[], StepStats | None] = lambda: None  # the engine's step times, if it keeps them
    engine_batches: Callable[[], BatchStats | None] = lambda: None  # the scheduler's batches (if kept)

    def add_closed(self, counters: dict[str, int]) -> None:
        for name, value in counters.items():
            self.closed_calls[name] = self.closed_calls.get(name, 0) + value

    def call_total(self, name: str) -> int:
        return self.closed_calls.get(name, 0) + self.live_calls().get(name, 0)

    def observe_engine(self, utterance_metrics: dict[str, float]) -> None:
        """One synthesized utterance's engine metrics (the `Done` event): stage times and its RTF."""
        if "rtf" in utterance_metrics:
            self.engine_rtf.observe(utterance_metrics["rtf"])
        for name, value in utterance_metrics.items():
            if name.endswith("_s") and name != "last_step_s":
                stage = name.removesuffix("_s")
                self.engine_stage_s[stage] = self.engine_stage_s.get(stage, 0.0) + value

    def error(self, code: str) -> None:
        self.errors_total[code] = self.errors_total.get(code, 0) + 1

    def http_error(self, status: int) -> None:
        self.http_errors_total[status] = self.http_errors_total.get(status, 0) + 1

    def render(self) -> str:
        """The Prometheus text exposition (version 0.0.4)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: Sequence[Sample]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f"{name}{_labels(lab)} {value:g}" for lab, value in samples)

        metric("voicertc_active_calls", "gauge", "Calls currently open.", [({}, self.active_calls())])
        metric("voicertc_calls_total", "counter", "Calls accepted.", [({}, self.calls_total)])
        for name, help_text in CALL_COUNTERS.items():
            metric(f"voicertc_{name}_total", "counter", help_text, [({}, self.call_total(name))])
        errors: list[Sample] = [({"code": code}, n) for code, n in sorted(self.errors_total.items())]
        metric(
            "voicertc_errors_total",
            "counter",
            "Error events reported to clients, by code.",
            errors or [({}, 0)],
        )
        http: list[Sample] = [
            ({"status": str(status)}, n) for status, n in sorted(self.http_errors_total.items())
        ]
        metric(
            "voicertc_http_errors_total", "counter", "HTTP 4xx/5xx responses, by status.", http or [({}, 0)]
        )
        stages = [({"stage": k}, v) for k, v in sorted(self.engine_stage_s.items())] or [({}, 0)]
        metric(
            "voicertc_engine_stage_seconds_total",
            "counter",
            "Engine time per stage (frontend, llm_prefill, flow, vocoder, synth, ttfa, ...), summed.",
            stages,
        )
        self._render_histogram(lines, "voicertc_ttfa_seconds", self.ttfa, TTFA_HELP)
        self._render_histogram(lines, "voicertc_engine_rtf", self.engine_rtf, RTF_HELP)
        steps = self.engine_steps()
        if steps is not None:
            self._render_steps(lines, metric, steps)
        batches = self.engine_batches()
        if isinstance(batches, BatchStats):
            self._render_batches(lines, metric, batches)
        return "\n".join(lines) + "\n"

    @staticmethod
    def _render_steps(lines: list[str], metric: Callable[..., None], steps: StepStats) -> None:
        hist = Histogram(tuple(ms / 1000.0 for ms in steps.buckets_ms))
        hist.counts, hist.total, hist.sum_s = list(steps.counts), steps.steps, steps.sum_ms / 1000.0
        Metrics._render_histogram(lines, "voicertc_engine_step_seconds", hist, STEP_HELP)
        metric(
            "voicertc_engine_step_max_seconds",
            "gauge",
            "The longest engine step so far.",
            [({}, steps.longest_ms / 1000.0)],
        )
        metric(
            "voicertc_engine_step_max_cpu_seconds",
            "gauge",
            "The engine thread's CPU time in its costliest step so far (not inflated by other processes).",
            [({}, steps.longest_cpu_ms / 1000.0)],
        )
        metric(
            "voicertc_engine_steps_over_budget_total",
            "counter",
            "Engine steps longer than engine.max_step_ms.",
            [({}, steps.over_budget)],
        )

    @staticmethod
    def _render_batches(lines: list[str], metric: Callable[..., None], stats: BatchStats) -> None:
        if stats.captured:
            metric(
                "voicertc_engine_captured_steps_total",
                "counter",
                "Captured static-shape steps per stage: replays, eager runs (a shape outside every bucket "
                "or past engine.graph_memory_mb), captures, buckets captured uncompiled (engine.compile: "
                "one that would have compiled again after warm-up), and decode steps launched_ahead (queued "
                "before the step before was read).",
                [({"stage": stage, "outcome": kind}, n)
                 for stage, counts in sorted(stats.captured.items()) for kind, n in sorted(counts.items())],
            )  # fmt: skip
        name = "voicertc_engine_batch_size"
        lines.append(f"# HELP {name} Units the scheduler ran as one batch, per stage (decode, flowchunk...).")
        lines.append(f"# TYPE {name} histogram")
        for stage, b in sorted(stats.stages.items()):
            for bound, count in zip(BATCH_SIZE_BUCKETS, b.counts, strict=True):
                lines.append(f'{name}_bucket{{stage="{stage}",le="{bound}"}} {count}')
            lines.append(f'{name}_bucket{{stage="{stage}",le="+Inf"}} {b.batches}')
            lines.append(f'{name}_sum{{stage="{stage}"}} {b.units}')
            lines.append(f'{name}_count{{stage="{stage}"}} {b.batches}')
        metric(
            "voicertc_engine_model_seconds_total",
            "counter",
            "Engine time inside the backend's batch runs (model work).",
            [({}, stats.model_s)],
        )
        metric(
            "voicertc_engine_host_seconds_total",
            "counter",
            "Engine loop time outside the model: planning, scheduling, writing audio, commands.",
            [({}, stats.host_s)],
        )
        metric(
            "voicertc_engine_runnable_units",
            "gauge",
            "Units of work runnable at the engine's latest iteration (queue depth).",
            [({}, stats.runnable)],
        )

    @staticmethod
    def _render_histogram(lines: list[str], name: str, hist: Histogram, help_text: str) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} histogram")
        for bound, count in zip(hist.buckets_s, hist.counts, strict=True):
            lines.append(f'{name}_bucket{{le="{bound:g}"}} {count}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {hist.total}')
        lines.append(f"{name}_sum {hist.sum_s:g}")
        lines.append(f"{name}_count {hist.total}")


TTFA_HELP = "Time to first audio frame, from when the utterance could play (opened, earlier speech over)."
STEP_HELP = "Wall time of one engine step (one backend synthesis call)."
RTF_HELP = "Engine real-time factor per utterance (synthesis time / audio time)."
