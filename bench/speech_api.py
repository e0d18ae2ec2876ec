"""Time to first audio of the agent paths next to the WebRTC call's, for the same texts.

    .venv/bin/python -m bench.speech_api [--engine piper|cosyvoice2] [--model-dir D] [--rounds 5]

`voicertc serve` runs in a child process on 127.0.0.1 (bench/peer.py `served`); this process is the
clients. For 1 and 8 concurrent clients, each round every client sends the same text at once, and
each path is timed on this process's clock from just before its request to its first audio:
- `http`: `POST /v1/audio/speech` (`response_format: pcm`), to the first body byte;
- `ws`: `text.delta` with `flush: true` (the whole text) on an open `/v1/tts/stream` socket, to the
  first binary frame;
- `webrtc`: `POST /v1/calls/{id}/speak` on a connected call, to the `speech.started` data-channel
  event (sent when the track hands the utterance's first 20 ms frame to aiortc's sender).
Paths take turns round by round. After its first audio each client stops the utterance (closes
the response, `cancel`, interrupt), the same for every path, so what is measured is the first chunk
under N simultaneous requests.
Prints a table (p50 / p95 ms per path, and each path minus webrtc at p50); writes
bench/results/speech_api_<engine>.json. Target: http and ws each <= the WebRTC TTFA + 20 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from bench.peer import PIPER_CONFIG_TOML, HttpPeer, served
from bench.report import summary, table, write_json
from voicertc.webrtc.loopback import patch_aioice_loopback

TEXTS = {
    "short": "Hello, how are you?",
    "medium": "I can help you book a table for dinner tonight.",
}
CLIENTS = (1, 8)
PATHS = ("http", "ws", "webrtc")
PAUSE_S = 0.3  # between rounds: the engine is idle when a round starts


# the benchmark's sockets wait while the other paths take their turns: no idle close (4408) meanwhile
BENCH_LIMITS = "[limits]\ntext_idle_timeout_s = 3600.0\n"


def cosyvoice_config(model_dir: Path) -> str:
    return PIPER_CONFIG_TOML.replace(
        'backend = "piper"', f'backend = "cosyvoice2"\nmodel_dir = "{model_dir}"'
    )


async def http_ttfa(http: aiohttp.ClientSession, url: str, text: str) -> float:
    body = {"model": "tts-1", "input": text, "voice": None, "response_format": "pcm"}
    start = time.monotonic()
    async with http.post(f"{url}/v1/audio/speech", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"/v1/audio/speech -> {resp.status}: {await resp.text()}")
        await resp.content.readany()
        ttfa_s = time.monotonic() - start
        resp.close()  # stop: the server cancels the utterance
    return 1000.0 * ttfa_s


async def _ws_drain_to_done(ws: aiohttp.ClientWebSocketResponse) -> None:
    while True:
        message = await ws.receive()
        if message.type == aiohttp.WSMsgType.TEXT and message.json()["type"] == "speech.done":
            return
        if message.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            raise RuntimeError(f"tts stream closed: {message}")


async def ws_ttfa(ws: aiohttp.ClientWebSocketResponse, text: str) -> float:
    start = time.monotonic()
    await ws.send_json({"type": "text.delta", "text": text, "flush": True})
    while True:
        message = await ws.receive()
        if message.type == aiohttp.WSMsgType.BINARY:
            ttfa_s = time.monotonic() - start
            break
        if message.type != aiohttp.WSMsgType.TEXT or message.json()["type"] == "error":
            raise RuntimeError(f"tts stream: {message}")
    await ws.send_json({"type": "cancel"})
    await _ws_drain_to_done(ws)
    return 1000.0 * ttfa_s


async def webrtc_ttfa(peer: HttpPeer, text: str) -> float:
    start = time.monotonic()
    utterance_id = await peer.speak(text)
    await peer.wait_event("speech.started", utterance_id)
    ttfa_s = time.monotonic() - start
    await peer.interrupt()
    return 1000.0 * ttfa_s


async def rounds(clients: list[Callable[[str], Awaitable[float]]], text: str, n_rounds: int) -> list[float]:
    samples: list[float] = []
    for _ in range(n_rounds):
        await asyncio.sleep(PAUSE_S)
        samples += await asyncio.gather(*(client(text) for client in clients))
    return samples


async def measure(url: str, n_rounds: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    async with aiohttp.ClientSession() as http:
        for n in CLIENTS:
            sockets = [await http.ws_connect(f"{url}/v1/tts/stream") for _ in range(n)]
            for ws in sockets:
                await ws.receive_json()  # session.created
            peers = [HttpPeer(http, url) for _ in range(n)]
            try:
                for peer in peers:
                    await peer.connect()
                paths: dict[str, list[Callable[[str], Awaitable[float]]]] = {
                    "http": [lambda t: http_ttfa(http, url, t) for _ in range(n)],
                    "ws": [lambda t, ws=ws: ws_ttfa(ws, t) for ws in sockets],
                    "webrtc": [lambda t, p=p: webrtc_ttfa(p, t) for p in peers],
                }
                for label, text in TEXTS.items():
                    await rounds(paths["http"], text, 1)  # warm-up, not counted
                    samples: dict[str, list[float]] = {path: [] for path in PATHS}
                    for _ in range(n_rounds):  # paths interleaved round by round: load drift hits all
                        for path in PATHS:
                            samples[path] += await rounds(paths[path], text, 1)
                    stats = {path: summary(samples[path]) for path in PATHS}
                    row: dict[str, object] = {"clients": n, "text": label}
                    for path in PATHS:
                        row[f"{path} p50"] = stats[path]["p50"]
                        row[f"{path} p95"] = stats[path]["p95"]
                    for path in ("http", "ws"):
                        row[f"{path} - webrtc p50"] = stats[path]["p50"] - stats["webrtc"]["p50"]
                    row["samples"] = stats["http"]["n"]
                    rows.append(row)
                    print(table([row], list(row)), flush=True)
            finally:
                for ws in sockets:
                    await ws.close()
                for peer in peers:
                    with contextlib.suppress(Exception):
                        await peer.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("piper", "cosyvoice2"), default="piper")
    parser.add_argument("--model-dir", type=Path, default=Path(".models/cv2_tiny"))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    patch_aioice_loopback()  # the client peers offer 127.0.0.1 like the server does
    config = PIPER_CONFIG_TOML if args.engine == "piper" else cosyvoice_config(args.model_dir.resolve())
    config += BENCH_LIMITS
    with served(config) as (url, _pid):
        rows = asyncio.run(measure(url, args.rounds))
    columns = list(rows[0])
    print(f"\nengine {args.engine}, {args.rounds} rounds per row (ms)\n" + table(rows, columns))
    path = write_json(
        f"speech_api_{args.engine}", {"engine": args.engine, "rounds": args.rounds, "rows": rows}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
