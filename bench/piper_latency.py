"""Piper on this machine: push_text -> first PCM in the ring, and -> first frame leaving the track.

    .venv/bin/python -m bench.piper_latency [--runs 20]

Real engine thread, real PcmRing/RingSink, real SpeechTrack paced on the monotonic clock (its recv()
is driven the way aiortc's sender drives it). Prints a table; writes bench/results/piper_latency.json.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from bench.report import summary, table, write_json
from voicertc.audio import PcmRing, RingSink
from voicertc.backends.piper import PiperBackend
from voicertc.engine import Done, FirstAudio
from voicertc.engine.worker import EngineWorker
from voicertc.webrtc.track import SpeechTrack

TEXTS = {
    "short (4 words)": "Hello, how are you?",
    "medium (10 words)": "I can help you book a table for dinner tonight.",
    "long (25 words)": (
        "The weather tomorrow will be mostly sunny in the morning, with a chance of light rain "
        "moving in from the west during the late afternoon hours."
    ),
}


async def one_run(engine: EngineWorker, sink: RingSink, track: SpeechTrack, text: str) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    first_pcm: asyncio.Future[float] = loop.create_future()
    done: asyncio.Future[Done] = loop.create_future()

    def on_event(event: object) -> None:
        now = time.monotonic()
        if isinstance(event, FirstAudio):
            loop.call_soon_threadsafe(lambda: first_pcm.done() or first_pcm.set_result(now))
        elif isinstance(event, Done):
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(event))

    t0 = time.monotonic()
    engine.say(None, sink, on_event, text)
    first_frame_s = None
    while first_frame_s is None or not done.done():  # keep draining: backpressure holds long texts
        frame = await track.recv()
        if first_frame_s is None and np.any(frame.to_ndarray()):
            first_frame_s = time.monotonic()
    first_pcm_s = await first_pcm
    result = await done
    track.interrupt()
    for _ in range(3):  # let the fade tail go out before the next run
        await track.recv()
    return {
        "first_pcm_ms": 1000 * (first_pcm_s - t0),
        "first_frame_ms": 1000 * (first_frame_s - t0),
        "rtf": result.metrics.get("rtf", float("nan")),
        "audio_s": result.audio_ms / 1000,
    }


async def main(runs: int) -> None:
    engine = EngineWorker(PiperBackend(threads=1))
    engine.start()
    ring = PcmRing(high_water_ms=4000)
    sink, track = RingSink(ring), SpeechTrack(ring)
    try:
        await one_run(engine, sink, track, "Warm up.")
        rows, record = [], {}
        for label, text in TEXTS.items():
            samples = [await one_run(engine, sink, track, text) for _ in range(runs)]
            stats = {k: summary([s[k] for s in samples]) for k in samples[0]}
            record[label] = {"text": text, **stats}
            rows.append(
                {
                    "sentence": label,
                    "runs": runs,
                    "first PCM p50 ms": stats["first_pcm_ms"]["p50"],
                    "first PCM p95 ms": stats["first_pcm_ms"]["p95"],
                    "first frame p50 ms": stats["first_frame_ms"]["p50"],
                    "first frame p95 ms": stats["first_frame_ms"]["p95"],
                    "RTF p50": stats["rtf"]["p50"],
                    "audio s": stats["audio_s"]["p50"],
                }
            )
        print(table(rows, list(rows[0])))  # noqa: T201 - benchmark output
        print("wrote", write_json("piper_latency", {"runs": runs, "results": record}))  # noqa: T201
    finally:
        track.stop()
        engine.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    asyncio.run(main(parser.parse_args().runs))
