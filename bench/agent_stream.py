"""Time to first audio of an agent's streamed reply: its words as text deltas, CosyVoice bistream.

    .venv/bin/python -m bench.agent_stream [--model-dir D] [--words-per-s 10] [--rounds 5]

`voicertc serve` (CosyVoice2 on `--model-dir`, default the tiny speaking directory, built if missing)
runs in a child process on 127.0.0.1, once per `[engine] bistream_unit` ("word", then "sentence").
Each round opens `/v1/tts/stream` and sends a reply one word per `text.delta` at `--words-per-s`,
as an LLM streams it, and times from the first delta to the first binary audio frame on this
process's clock; then `cancel`. The reply's first sentence is 16 words, so with "sentence" no text
reaches the LLM before its 16th word; with "word" the LLM starts on the first completed words.
Prints a table (p50 / p95 ms per unit) and writes bench/results/agent_stream.json.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import aiohttp

from bench.make_tiny_model_dir import make_tiny_model_dir
from bench.peer import PIPER_CONFIG_TOML, served
from bench.report import summary, table, write_json

REPLY = (
    "Sure, I can help you book a table for two at the Italian place on Main Street tonight. "
    "Would seven work for you?"
)
UNITS = ("word", "sentence")


def config_toml(model_dir: Path, unit: str) -> str:
    return PIPER_CONFIG_TOML.replace(
        'backend = "piper"',
        f'backend = "cosyvoice2"\nmodel_dir = "{model_dir}"\nbistream_unit = "{unit}"',
    )


async def first_audio_ms(http: aiohttp.ClientSession, url: str, words_per_s: float) -> float:
    words = REPLY.split(" ")
    async with http.ws_connect(f"{url.replace('http', 'ws', 1)}/v1/tts/stream") as ws:
        await ws.receive_json()  # session.created
        first_audio = asyncio.get_running_loop().create_future()

        async def read() -> None:
            async for message in ws:
                if message.type == aiohttp.WSMsgType.BINARY and not first_audio.done():
                    first_audio.set_result(time.monotonic())
                elif message.type == aiohttp.WSMsgType.TEXT and message.json()["type"] == "error":
                    first_audio.set_exception(RuntimeError(message.data))

        reader = asyncio.create_task(read())
        start = time.monotonic()
        for i, word in enumerate(words):
            if first_audio.done():
                break
            delta = word if i == 0 else " " + word
            await ws.send_json({"type": "text.delta", "text": delta, "flush": i == len(words) - 1})
            await asyncio.sleep(max(0.0, start + (i + 1) / words_per_s - time.monotonic()))
        heard = await asyncio.wait_for(first_audio, 60)
        await ws.send_json({"type": "cancel"})
        reader.cancel()
        return 1000.0 * (heard - start)


async def measure(model_dir: Path, words_per_s: float, rounds: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for unit in UNITS:
        with served(config_toml(model_dir, unit)) as (url, _pid):
            async with aiohttp.ClientSession() as http:
                await first_audio_ms(http, url, words_per_s)  # warm-up
                values = [await first_audio_ms(http, url, words_per_s) for _ in range(rounds)]
        print(f"  {unit}: {[round(v) for v in values]} ms", flush=True)
        rows.append({"bistream_unit": unit, **summary(values)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=Path(".models/cv2_tiny"))
    parser.add_argument("--words-per-s", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not (args.model_dir / "cosyvoice2.yaml").is_file():
        make_tiny_model_dir(args.model_dir)
    rows = asyncio.run(measure(args.model_dir.resolve(), args.words_per_s, args.rounds))
    print(table(rows, ["bistream_unit", "n", "p50", "p95", "min", "max"]))
    write_json("agent_stream", {"words_per_s": args.words_per_s, "rows": rows})


if __name__ == "__main__":
    main()
