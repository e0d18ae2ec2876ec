"""Other calls while voices register: their TTFA and playout gaps while clips of 5, 15 and 30 s are posted.

    .venv/bin/python -m bench.voice_register [--clips 5 15 30] [--runs 3] [--seconds 10]
    .venv/bin/python -m bench.voice_register --engine cosyvoice2 --model-dir .models/cv2_tiny

One fresh `voicertc serve` per clip length and run. Two speaker calls keep long utterances queued; a
probe call speaks a short sentence again and again (TTFA from `speech.started`). First a quiet
window (no registrations), then a window with `POST /v1/voices` of the clip back to back. Reported
per window: the probe's TTFA p50/p95, the speakers' `gaps_over_100ms` / `late_frames` /
`underrun_frames` (server side) and pauses over 100 ms between received frames (client side), and
the registrations' status and wall time. On Piper a registration is decoded and checked (the
streamed, capped decode in a worker thread) and then answered 400 `not_supported` by the engine; on
CosyVoice2 it also computes the voice's features.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import time
import wave
from typing import Any

import aiohttp
import numpy as np

from bench.listen_load import Speaker, keep_speaking
from bench.peer import HttpPeer, served
from bench.report import machine, summary, table, write_json
from voicertc.webrtc.loopback import patch_aioice_loopback

PROBE_TEXT = "Hello there, how are you?"
CLIP_RATE_HZ = 24000


def config_toml(engine: str, model_dir: str, voices_dir: str) -> str:
    engine_lines = f'backend = "{engine}"\n' + (f'model_dir = "{model_dir}"\n' if model_dir else "")
    return (
        "[server]\nport = 0\n[webrtc]\nloopback_only = true\n"
        f'[engine]\n{engine_lines}voices_dir = "{voices_dir}"\n'
        '[listen]\nenabled = false\n[limits]\nmax_voices = 100000\n[logging]\nlevel = "WARNING"\n'
    )


def voiced_wav(seconds: float) -> bytes:
    """A voiced-sounding clip (180 Hz with tremolo) as 16-bit mono WAV."""
    t = np.arange(int(seconds * CLIP_RATE_HZ)) / CLIP_RATE_HZ
    pcm = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(CLIP_RATE_HZ)
        wav.writeframes((pcm * 32767).astype("<i2").tobytes())
    return out.getvalue()


async def probe_ttfa(probe: HttpPeer, until_s: float) -> list[float]:
    """Speak PROBE_TEXT until `until_s`, one at a time; TTFA (ms) of each."""
    ttfa = []
    while time.monotonic() < until_s:
        uid = await probe.speak(PROBE_TEXT)
        started = await probe.wait_event("speech.started", utterance_id=uid, timeout_s=60)
        ttfa.append(float(started["ttfa_ms"]))
        await probe.wait_event("speech.done", utterance_id=uid, timeout_s=60)
    return ttfa


async def register_loop(http: aiohttp.ClientSession, url: str, clip: bytes, until_s: float) -> list[dict]:
    done = []
    n = 0
    while time.monotonic() < until_s:
        n += 1
        form = aiohttp.FormData()
        form.add_field("audio", clip, filename="clip.wav", content_type="audio/wav")
        form.add_field("transcript", "A clip to register.")
        t0 = time.monotonic()
        async with http.post(f"{url}/v1/voices", data=form) as resp:
            body = await resp.json()
        done.append(
            {"status": resp.status, "s": time.monotonic() - t0, "code": body.get("error", {}).get("code")}
        )
        if resp.status == 201:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.delete(f"{url}/v1/voices/{body['id']}"):
                    pass
    return done


async def window(
    http: aiohttp.ClientSession,
    url: str,
    speakers: list[Speaker],
    probe: HttpPeer,
    seconds: float,
    clip: bytes | None,
) -> dict[str, Any]:
    before = [await s.info() for s in speakers]
    until = time.monotonic() + seconds
    for s in speakers:
        s.window, s.client_gaps = (time.monotonic(), until), 0
    jobs = [probe_ttfa(probe, until)]
    if clip is not None:
        jobs.append(register_loop(http, url, clip, until))
    results = await asyncio.gather(*jobs)
    after = [await s.info() for s in speakers]

    def delta(key: str) -> int:
        return sum(a[key] - b[key] for a, b in zip(after, before, strict=True))

    ttfa = results[0]
    registrations = results[1] if clip is not None else []
    return {
        "ttfa_p50_ms": float(np.percentile(ttfa, 50)) if ttfa else None,
        "ttfa_p95_ms": float(np.percentile(ttfa, 95)) if ttfa else None,
        "speaker_gaps_server": delta("gaps_over_100ms"),
        "speaker_late_frames": delta("late_frames"),
        "speaker_underrun_frames": delta("underrun_frames"),
        "speaker_gaps_client": sum(s.client_gaps for s in speakers),
        "registrations": len(registrations),
        "registration_s_p50": float(np.percentile([r["s"] for r in registrations], 50))
        if registrations
        else None,
        "registration_status": sorted({f"{r['status']} {r['code'] or ''}".strip() for r in registrations}),
    }


async def one_run(args: argparse.Namespace, clip_s: float, voices_dir: str) -> list[dict[str, Any]]:
    clip = voiced_wav(clip_s)
    rows = []
    with served(config_toml(args.engine, args.model_dir, voices_dir)) as (url, _pid):
        async with aiohttp.ClientSession() as http:
            speakers = [Speaker(http, url) for _ in range(2)]
            probe = HttpPeer(http, url)
            for peer in [*speakers, probe]:
                await peer.connect()
            stop = asyncio.Event()
            talkers = [asyncio.ensure_future(keep_speaking(s, stop)) for s in speakers]
            try:
                await asyncio.sleep(2.0)
                for label, body in (("quiet", None), ("registering", clip)):
                    row = await window(http, url, speakers, probe, args.seconds, body)
                    rows.append({"clip_s": clip_s, "window": label, **row})
            finally:
                stop.set()
                await asyncio.gather(*talkers, return_exceptions=True)
                for peer in [*speakers, probe]:
                    await peer.close()
    return rows


async def main_async(args: argparse.Namespace) -> None:
    restore = patch_aioice_loopback()
    rows: list[dict[str, Any]] = []
    voices_dir = os.path.join(os.path.dirname(__file__), "results", "voice_register_voices")
    try:
        for run in range(args.runs):
            for clip_s in args.clips:
                for row in await one_run(args, clip_s, voices_dir):
                    row["run"] = run
                    print(f"  run {run}: {row}", flush=True)
                    rows.append(row)
    finally:
        restore()
    metrics = [k for k in rows[0] if k not in ("clip_s", "window", "run", "registration_status")]
    result_rows = []
    for clip_s in args.clips:
        for label in ("quiet", "registering"):
            mine = [r for r in rows if r["clip_s"] == clip_s and r["window"] == label]
            for metric in metrics:
                values = [r[metric] for r in mine if r[metric] is not None]
                if values:
                    result_rows.append(
                        {"clip_s": clip_s, "window": label, "metric": metric, **summary(values)}
                    )
    load = os.getloadavg()
    print(f"\nload average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} ({os.cpu_count()} CPUs, shared)")
    print(table(result_rows, ["clip_s", "window", "metric", "n", "p50", "p95", "max"]))
    path = write_json(
        "voice_register", {"args": vars(args), "machine": machine(), "runs": rows, "summary": result_rows}
    )
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clips", type=float, nargs="+", default=[5.0, 15.0, 30.0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--engine", default="piper", choices=["piper", "cosyvoice2"])
    parser.add_argument("--model-dir", default="")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
