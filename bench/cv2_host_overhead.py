"""Host overhead per LLM decode step per utterance, through the real engine on the tiny model.

    .venv/bin/python -m bench.make_tiny_model_dir .models/cv2_tiny
    .venv/bin/python -m bench.cv2_host_overhead --model-dir .models/cv2_tiny [--batch 1 16]

B utterances run through `EngineWorker` + `CosyVoice2Backend` (whole text, `--max-tokens` speech tokens
each). For every decode iteration the worker reports the engine thread's CPU time of the whole loop
iteration (planning, scheduling, sampling, writing audio, the forward); the backbone forward and the
LLM head (`SlotKV.forward`, `Qwen2LM.feed`) are timed separately on the same thread. Host overhead =
(iteration CPU - forward CPU) / row-steps, in µs. Thread CPU time, not wall time, so other processes
on the machine inflate it little. Writes bench/results/cv2_host_overhead.json.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

from bench.cv2_load import pick_voice
from bench.report import table, write_json
from voicertc.backends.cosyvoice.llm import kv as llm_kv
from voicertc.backends.cosyvoice.llm.qwen2lm import Qwen2LM
from voicertc.backends.cosyvoice.load import load_v2 as load
from voicertc.backends.cosyvoice.serve.backend import BackendOptions, CosyVoice2Backend
from voicertc.engine import Done, EngineEvent, Failed
from voicertc.engine.worker import BatchReport, EngineWorker

TEXT = "The quick brown fox jumps over the lazy dog, while the band plays on the square tonight."


class NullSink:
    """Takes every piece at once (no playback, no backpressure): only the engine's work is measured."""

    generation = 0
    queued_ms = 10_000.0  # never "starving": the scheduler's priorities stay out of the measurement

    def write(self, pcm, sample_rate_hz, utterance_id, generation) -> bool:  # noqa: ANN001
        return True

    def end_utterance(self, utterance_id: str, generation: int) -> None:
        pass

    def mark_text(self, utterance_id: str, generation: int, text: str) -> None:
        pass

    def abort_utterance(self, utterance_id: str, generation: int) -> None:
        pass

    def has_room(self) -> bool:
        return True

    def set_space_listener(self, callback) -> None:  # noqa: ANN001
        pass


class ForwardClock:
    """Engine-thread CPU time spent in the LLM forward (patched in for the run)."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.depth = 0

    def wrap(self, fn):  # noqa: ANN001, ANN201 - a plain function wrapper
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.depth += 1
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.cpu_s += time.thread_time() - started

        return timed


def run(model, batch: int, max_tokens: int) -> dict[str, object]:
    backend = CosyVoice2Backend(model, options=BackendOptions(seed=7, max_segment_tokens=max_tokens))
    voice = pick_voice(backend, model)
    clock = ForwardClock()
    decode_cpu = [0.0]

    def observe(report: BatchReport) -> None:
        if report.stage == "decode":
            decode_cpu[0] += report.cpu_s

    forward, feed = llm_kv.SlotKV.forward, Qwen2LM.feed
    llm_kv.SlotKV.forward = clock.wrap(forward)  # type: ignore[method-assign]
    Qwen2LM.feed = clock.wrap(feed)  # type: ignore[method-assign]
    engine = EngineWorker(backend, observer=observe, max_batch=max(16, batch))
    done = threading.Semaphore(0)

    def on_event(event: EngineEvent) -> None:
        if isinstance(event, Done | Failed):
            done.release()

    engine.start()
    try:
        for _ in range(batch):
            engine.say(voice, NullSink(), on_event, TEXT)
        for _ in range(batch):
            done.acquire(timeout=600)
    finally:
        engine.stop()
        llm_kv.SlotKV.forward = forward  # type: ignore[method-assign]
        Qwen2LM.feed = feed  # type: ignore[method-assign]
    rows = backend.stats["decode_rows"]
    host_s = decode_cpu[0] - clock.cpu_s
    return {
        "batch": batch,
        "decode_iterations": engine.batch_stats.stages["decode"].batches,
        "decode_row_steps": rows,
        "mean_rows_per_forward": rows / max(1, backend.stats["decode_batches"]),
        "host_us_per_row_step": 1e6 * host_s / max(1, rows),
        "forward_us_per_row_step": 1e6 * clock.cpu_s / max(1, rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = load(args.model_dir)
    results = [run(model, b, args.max_tokens) for b in args.batch for _ in range(args.runs)]
    print(table(results, list(results[0])))
    load_avg = os.getloadavg()[0]
    print(f"load average (1 min): {load_avg:.1f}")
    print(f"wrote {write_json('cv2_host_overhead', {'results': results, 'load_avg_1m': load_avg})}")


if __name__ == "__main__":
    main()
