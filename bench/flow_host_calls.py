"""Host work of a flow chunk on the captured path, counted: the ATen calls a GPU would pay launches for.

    .venv/bin/python -m bench.make_full_model_dir      # once: .models/cv2_full
    .venv/bin/python -m bench.flow_host_calls [--rows 1 4 16]

A CUDA graph's replay costs one launch whatever it holds; what a chunk still runs from Python around its
replays is what bounds it on a GPU (the eager token encoder was ~3,200 ATen calls for one first chunk,
27.8 ms on an H100). For N utterances started together on one voice (full-size random weights, CPU), the
first chunk's encoder part (`start_stream_batch`) is profiled with the eager token encoder and with the
captured one (`flow.captured_encoder`), and the Euler part (`advance_stream`, 10 steps) through the
captured estimator; every replay here is the step run once at capture and then handed back for free,
so the counts are the host calls around the replays. A count, not a time: deterministic for a given
tree. Prints a table and writes bench/results/flow_host_calls.json.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_flow_probe import first_chunk_inputs
from bench.gpu_probe import make_voice
from bench.make_full_model_dir import DEFAULT_OUT, make_full_model_dir
from bench.report import table, write_json
from voicertc.backends.cosyvoice.accel.captured import Outputs
from voicertc.backends.cosyvoice.flow.flow import StreamSolve
from voicertc.backends.cosyvoice.load import load_v2
from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
from voicertc.backends.cosyvoice.serve.captured_stages import install_captured_steps
from voicertc.backends.cosyvoice.serve.streams import token2wav_stream
from voicertc.backends.cosyvoice.voice.voices import Voice
from voicertc.engine import ChunkSchedule


def replay_free(step: Callable[[], Outputs]) -> Callable[[], Outputs]:
    """A capture whose replay costs nothing on the host (as a CUDA graph's one launch, near enough)."""
    outputs = step()
    return lambda: outputs


def aten_calls(fn: Callable[[], object]) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def first_chunk(model: CosyVoice2Model, voice: Voice, rows: int, euler: bool) -> tuple[int, int | None]:
    """ATen calls of N first chunks: (encoder part, Euler part or None); the second of two runs (warm)."""
    return [_chunk_calls(model, voice, rows, euler) for _ in range(2)][-1]


def _chunk_calls(model: CosyVoice2Model, voice: Voice, rows: int, euler: bool) -> tuple[int, int | None]:
    schedule = ChunkSchedule()
    first = schedule.first_hop_tokens + schedule.lookahead_tokens
    t2ws = [token2wav_stream(model, voice, schedule, pcm_to_host=_to_numpy) for _ in range(rows)]
    try:
        tokens, states = first_chunk_inputs(t2ws, [[1] * first for _ in t2ws])
        with torch.inference_mode():
            solved: list[StreamSolve] = []
            encode = aten_calls(lambda: solved.append(model.flow.start_stream_batch(tokens, states, False)))
            steps = aten_calls(lambda: model.flow.advance_stream(solved[0])) if euler else None
        return encode, steps
    finally:
        for t2w in t2ws:
            t2w.release()


def _to_numpy(pcm: torch.Tensor) -> np.ndarray:
    return pcm.detach().numpy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default=str(DEFAULT_OUT))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--euler-up-to", type=int, default=4,
        help="count the Euler part up to this many utterances (on a CPU each context reserves 30 s of "
        "room: 16 utterances' ten Euler contexts pass this VM's 24 GB)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    make_full_model_dir(DEFAULT_OUT) if args.model_dir == str(DEFAULT_OUT) else None
    model = load_v2(args.model_dir, "cpu", torch.float32)
    stages = install_captured_steps(model, max(args.rows), 8192.0, replay_free)
    voice = make_voice(model)
    results = []
    for rows in args.rows:
        runner = model.flow.encoder_runner
        model.flow.encoder_runner = None
        eager_encode, _ = first_chunk(model, voice, rows, euler=False)
        model.flow.encoder_runner = runner
        encode, euler = first_chunk(model, voice, rows, euler=rows <= args.euler_up_to)
        results.append(
            {"utterances": rows, "encoder part, eager encoder": eager_encode,
             "encoder part, captured encoder": encode,
             "euler part (10 steps)": "" if euler is None else euler}
        )  # fmt: skip
    print(table(results, list(results[0])))  # noqa: T201 - benchmark output
    counts = {name: vars(st) | {"by_shape": len(st.by_shape)} for name, st in stages.stats().items()}
    print("wrote", write_json("flow_host_calls", {"args": vars(args), "results": results, "stages": counts}))  # noqa: T201


if __name__ == "__main__":
    main()
