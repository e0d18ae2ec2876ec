"""CosyVoice2 (or 3) engine under load: N utterances start at once; TTFA p50/p95, RTF and underruns.

    .venv/bin/python -m bench.cv2_load --device cuda --dtype float16 [--concurrency 1 8 32]
    .venv/bin/python -m bench.cv2_load --version 3 --device cuda --dtype bfloat16 --cuda-graphs  # CosyVoice3
    .venv/bin/python -m bench.make_tiny_model_dir .models/cv2_tiny \\
        && .venv/bin/python -m bench.cv2_load --model-dir .models/cv2_tiny --concurrency 1 4   # CPU smoke

The real engine (`EngineWorker` + `CosyVoice2Backend`: LLM, batched flow, HiFT) writes each utterance
through a `RingSink` into its own `PcmRing`, as a call does. One playout thread reads every ring 20 ms at
a time on an absolute schedule, as `SpeechTrack` does. From an utterance's first sample until its end
mark, a read that finds less than 20 ms queued counts one underrun frame.

Per level it reports TTFA (the engine's `FirstAudio.ttfa_ms`) p50/p95/max, RTF p50/max (`Done.metrics`),
underrun frames (total, and how many utterances had any), and the wall time. The voice is the model's
first sft voice, or a random zero-shot voice with a 3 s prompt. Utterance length is capped by
`--max-tokens` speech tokens (random weights rarely stop by themselves).
`--version 3` runs the `cosyvoice3` backend on a CosyVoice3 directory (default `.models/cv3_full`, built
when missing; its LLM stays float32 whatever `--dtype` says, as the engine keeps it).
Prints a table; writes bench/results/cv2_load_<device>.json (cv3_load_... for `--version 3`).
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

from bench.make_full_model_dir import DEFAULT_OUT, DEFAULT_OUT_V3, make_full_model_dir
from bench.report import summary, table, write_json
from voicertc.audio import PcmRing, RingSink
from voicertc.backends.cosyvoice.flow.dit import use_matmul_convs
from voicertc.backends.cosyvoice.llm.streamer import ThreadedSpeechLlm
from voicertc.backends.cosyvoice.load import load_v2 as load
from voicertc.backends.cosyvoice.load import load_v3
from voicertc.backends.cosyvoice.load.files import DTYPES
from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
from voicertc.backends.cosyvoice.serve.backend import BackendOptions, CosyVoice2Backend
from voicertc.backends.cosyvoice.serve.backend_v3 import CosyVoice3Backend
from voicertc.backends.cosyvoice.voice.voices import voice_from_features
from voicertc.engine import Done, EngineEvent, Failed, FirstAudio
from voicertc.engine.worker import EngineWorker

TEXT = "The quick brown fox jumps over the lazy dog, while the band plays on the square tonight."
TRANSCRIPT = "Hello world, this is a voice prompt for the load benchmark."
FRAME_SAMPLES = 960  # 20 ms at 48 kHz


@dataclass
class Playout:
    """One utterance's ring as a call would play it; touched by the playout thread only (and `done`
    by the engine thread)."""

    ring: PcmRing
    started: bool = False
    ended: bool = False
    underrun_frames: int = 0
    events: list[EngineEvent] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def on_event(self, event: EngineEvent) -> None:
        self.events.append(event)
        if isinstance(event, Done | Failed):
            self.done.set()

    def play_frame(self) -> None:
        read = self.ring.read(FRAME_SAMPLES)
        if self.ended:
            return
        self.started = self.started or len(read.pcm) > 0
        self.ended = any(span.ended for span in read.spans)
        if self.started and not self.ended and len(read.pcm) < FRAME_SAMPLES:
            self.underrun_frames += 1


def play(streams: list[Playout], stop: threading.Event) -> None:
    """Read every ring every 20 ms on an absolute schedule until `stop`."""
    next_s = time.monotonic()
    while not stop.is_set():
        for stream in streams:
            stream.play_frame()
        next_s += FRAME_SAMPLES / 48000
        stop.wait(max(0.0, next_s - time.monotonic()))


def pick_voice(backend: CosyVoice2Backend, model: CosyVoice2Model) -> str:
    if backend.voices():
        return backend.voices()[0]
    gen = torch.Generator().manual_seed(11)
    voice = voice_from_features(
        model,
        torch.randint(0, model.flow.cfg.vocab_size, (1, 75), generator=gen),
        torch.randn(1, 150, 80, generator=gen) - 3.0,
        torch.randn(1, 192, generator=gen),
        model.text_frontend.encode(TRANSCRIPT),
        voice_id="bench",
    )
    return backend.add_voice(voice, persist=False)


def run_level(engine: EngineWorker, voice: str, concurrency: int, timeout_s: float) -> dict[str, object]:
    streams = [Playout(PcmRing(high_water_ms=4000.0, margin_ms=500.0)) for _ in range(concurrency)]
    stop = threading.Event()
    player = threading.Thread(target=play, args=(streams, stop), daemon=True)
    player.start()
    mallocs = _device_mallocs()
    started = time.monotonic()
    for stream in streams:
        engine.say(voice, RingSink(stream.ring), stream.on_event, TEXT)
    finished = all(stream.done.wait(max(0.0, started + timeout_s - time.monotonic())) for stream in streams)
    wall_s = time.monotonic() - started
    while not all(s.ended or not s.started for s in streams) and time.monotonic() < started + timeout_s:
        time.sleep(0.05)  # let playback reach every end mark
    stop.set()
    player.join()
    ttfa = [e.ttfa_ms for s in streams for e in s.events if isinstance(e, FirstAudio)]
    rtf = [e.metrics.get("rtf", float("nan")) for s in streams for e in s.events if isinstance(e, Done)]
    failed = [e.message for s in streams for e in s.events if isinstance(e, Failed)]
    underruns = [s.underrun_frames for s in streams]
    return {
        "concurrency": concurrency,
        "finished": finished,
        "failed": failed,
        "wall_s": wall_s,
        "ttfa_ms": summary(ttfa) if ttfa else None,
        "rtf": summary(rtf) if rtf else None,
        "underrun_frames": underruns,
        # device memory segments the allocator had to get from the driver during the level (cudaMalloc
        # synchronises the device: a level's first units pay for the contexts no earlier level grew to)
        "device_mallocs": None if mallocs is None else (_device_mallocs() or 0) - mallocs,
    }


def profiled_level(
    engine: EngineWorker, voice: str, concurrency: int, timeout_s: float, out: dict[str, object]
) -> dict[str, object]:
    """`run_level` under torch.profiler; the top ops by host and by device time go into `out` (tables)."""
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # every thread (the engine's works on its own), and on CUDA its synchronisations as events
    config = _ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=cuda)
    with profile(activities=activities, experimental_config=config) as prof:
        result = run_level(engine, voice, concurrency, timeout_s)
        if cuda:
            torch.cuda.synchronize()
    averages = prof.key_averages()
    out["level"] = concurrency
    out["by host time"] = averages.table(sort_by="self_cpu_time_total", row_limit=30)
    if cuda:
        out["by device time"] = averages.table(sort_by="self_cuda_time_total", row_limit=30)
    return result


def _device_mallocs() -> int | None:
    """cudaMalloc calls of torch's caching allocator so far (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.memory_stats().get("segment.all.allocated", 0))


def _row(result: dict) -> dict[str, object]:
    ttfa, rtf, underruns = result["ttfa_ms"] or {}, result["rtf"] or {}, result["underrun_frames"]
    return {
        "utterances": result["concurrency"],
        "ttfa p50 ms": ttfa.get("p50", ""),
        "ttfa p95 ms": ttfa.get("p95", ""),
        "ttfa max ms": ttfa.get("max", ""),
        "rtf p50": rtf.get("p50", ""),
        "rtf max": rtf.get("max", ""),
        "underrun frames": sum(underruns),
        "utterances with underruns": sum(1 for u in underruns if u),
        "failed": len(result["failed"]),
        "wall s": result["wall_s"],
        "device mallocs": "" if result["device_mallocs"] is None else result["device_mallocs"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", type=int, choices=[2, 3], default=2, help="CosyVoice2 or 3")
    parser.add_argument("--model-dir", default="", help="default: the full-size random directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=250, help="speech tokens per utterance at most")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--cuda-graphs", action="store_true", help="[engine] cuda_graphs (CUDA only)")
    parser.add_argument("--compile", action="store_true", help="with --cuda-graphs: [engine] compile")
    parser.add_argument("--llm", choices=["torch", "thread"], default="torch", help="[engine] llm")
    parser.add_argument(
        "--no-decode-ahead", action="store_true", help="with --cuda-graphs: read every decode step at once"
    )
    parser.add_argument(
        "--profile-level",
        type=int,
        default=0,
        help="run this concurrency level under torch.profiler: the top ops by host and by device time "
        "(CUDA kernels and runtime calls such as cudaMalloc, from every thread) printed and in the JSON",
    )
    parser.add_argument(
        "--dit-conv", choices=["conv1d", "matmul"], default="conv1d", help="[engine] dit_conv"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    for name in ("serve.backend", "serve.captured_stages"):  # warm-up: admission cap, captured buckets
        logging.getLogger(f"voicertc.backends.cosyvoice.{name}").setLevel(logging.INFO)
    torch.set_num_threads(args.threads)
    if not args.model_dir:
        default = DEFAULT_OUT_V3 if args.version == 3 else DEFAULT_OUT
        args.model_dir = str(make_full_model_dir(default, version=args.version))
    dtype = DTYPES[args.dtype] if args.device != "cpu" else torch.float32
    model = (
        load_v3(args.model_dir, args.device, dtype)
        if args.version == 3
        else load(args.model_dir, args.device, dtype)
    )
    options = BackendOptions(
        seed=5,
        max_segment_tokens=args.max_tokens,
        cuda_graphs=args.cuda_graphs,
        compile_steps=args.compile and args.cuda_graphs,
        decode_ahead=not args.no_decode_ahead,
        graph_rows=max(args.concurrency),
        # memory admission sized for these utterances: --max-tokens of own speech (the prompt is shared)
        streaming_context_s=max(1.0, args.max_tokens / 25),
    )
    streamer = None
    if args.llm == "thread":  # with --cuda-graphs: its own decode graphs and CUDA stream (create_backend's)
        graphs = args.cuda_graphs and model.device.type == "cuda"
        streamer = ThreadedSpeechLlm(model.llm, slots=max(args.concurrency), graphs=graphs)
    if args.version == 3:
        if streamer is not None:
            parser.error("--llm thread is CosyVoice2's only")
        use_matmul_convs(model.flow.decoder.estimator, args.dit_conv == "matmul")
        backend: CosyVoice2Backend = CosyVoice3Backend(model, options=options)
    else:
        backend = CosyVoice2Backend(model, options=options, streamer=streamer)
    if streamer is not None:
        streamer.start()
    voice = pick_voice(backend, model)
    backend.warm_up()  # as create_backend does: kernels, allocators, and the decode graphs if asked
    # one batch holds every utterance of the largest level, as the captured buckets do (`graph_rows`; the
    # server sets both from `[engine] max_batch`); until 2026-11-27 the worker's default of 16 split 32
    # utterances into two decode forwards a step and two flow groups, past buckets captured for 32
    engine = EngineWorker(
        backend,
        default_voice=voice,
        max_utterances=max(args.concurrency) + 1,
        max_batch=max(args.concurrency),
    )
    engine.start()
    try:
        run_level(engine, voice, 1, args.timeout_s)  # warm-up: kernels, allocator, caches
        profiled: dict[str, object] = {}
        results = [
            profiled_level(engine, voice, n, args.timeout_s, profiled)
            if n == args.profile_level
            else run_level(engine, voice, n, args.timeout_s)
            for n in args.concurrency
        ]
        # replays / eager fallbacks / captures over every level (read before the stop closes the stages)
        captured = backend.captured_counts()
    finally:
        engine.stop()
    print(table([_row(r) for r in results], list(_row(results[0]))))  # noqa: T201 - benchmark output
    if captured:
        print("captured stages (replays / eager / captures):", captured)  # noqa: T201
    for title in ("by host time", "by device time"):
        if title in profiled:
            print(f"profile of {args.profile_level} at once, {title}:\n{profiled[title]}")  # noqa: T201
    record = {
        "args": vars(args), "device_name": _device_name(args.device), "results": results,
        "captured": captured, "profile": profiled,
    }  # fmt: skip
    name = f"cv{args.version}_load_{args.device.split(':')[0]}_{args.dtype}"
    if args.dit_conv != "conv1d":
        name += f"_{args.dit_conv}"
    name += "_graphs" if args.cuda_graphs else ""
    name += "_compiled" if args.compile else ""
    name += "_stepped" if args.no_decode_ahead else ""
    name += f"_profiled{args.profile_level}" if args.profile_level else ""
    name += "" if args.llm == "torch" else f"_llm_{args.llm}"
    print("wrote", write_json(name, record))  # noqa: T201


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


if __name__ == "__main__":
    main()
