"""`voicertc serve`: run the server from config.toml plus command-line overrides until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from aiohttp import web

from signaling.app import create_app, http_url, listen_error
from signaling.drain import DRAIN
from voicertc.config import BACKENDS, ENGINE_KINDS, Config, load_config
from voicertc.errors import ConfigError, VoiceRTCError

logger = logging.getLogger("voicertc")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voicertc", description="Real-time WebRTC text-to-speech server.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HTTP/WebRTC server")
    serve.add_argument("--config", help="config.toml (default: ./config.toml when present, else defaults)")
    serve.add_argument("--host", help="bind address (server.host)")
    serve.add_argument("--port", type=int, help="TCP port (server.port); 0 picks a free one")
    serve.add_argument("--engine", choices=BACKENDS + ENGINE_KINDS, help="engine backend (engine.backend)")
    serve.add_argument("--model", choices=BACKENDS, help="model with --engine local|ray (engine.model)")
    serve.add_argument("--model-dir", help="CosyVoice2 / CosyVoice3 model directory (engine.model_dir)")
    from voicertc.export.cli import add_commands

    add_commands(commands)
    from voicertc.remote.cli import add_commands as add_remote_commands

    add_remote_commands(commands)
    return parser


def resolve_config(args: argparse.Namespace) -> Config:
    """The config file (explicit, or ./config.toml) with the flags applied on top, validated."""
    path = args.config
    if path is None and Path("config.toml").is_file():
        path = "config.toml"
    config = load_config(path)
    server = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if server:
        config = config.replace("server", **server)
    engine = {
        k: v
        for k, v in (("backend", args.engine), ("model", args.model), ("model_dir", args.model_dir))
        if v is not None
    }
    if engine:
        config = config.replace("engine", **engine)
    return config


async def serve(config: Config) -> None:
    """Run until SIGINT/SIGTERM, drain (calls finish their current utterance, up to
    `server.drain_timeout_s`; a second signal cuts it short), then close every call and stop the engine."""
    app = create_app(config)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()  # starts the engine
    try:
        await web.TCPSite(runner, config.server.host, config.server.port).start()
    except OSError as exc:
        await runner.cleanup()  # stops the engine again
        raise listen_error(config, exc) from exc
    port = runner.addresses[0][1] if runner.addresses else config.server.port
    print(
        f"voicertc serving on {http_url(config.server.host, port)}/ (engine {config.engine.backend})",
        flush=True,
    )
    signals = asyncio.Queue[int]()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    try:
        logger.info("%s: draining, then shutting down", signal.Signals(await signals.get()).name)
        drain = asyncio.ensure_future(app[DRAIN].run())
        again = asyncio.ensure_future(signals.get())
        await asyncio.wait({drain, again}, return_when=asyncio.FIRST_COMPLETED)
        if not drain.done():
            logger.info("second signal: drain cut short")
            drain.cancel()
        again.cancel()
        await asyncio.wait({drain, again})
    finally:
        await runner.cleanup()
        logger.info("stopped")


def _run(config: Config) -> None:
    if config.server.use_uvloop:
        try:
            import uvloop
        except ImportError:
            logger.info("uvloop not installed; using asyncio's loop")
        else:
            uvloop.run(serve(config))
            return
    asyncio.run(serve(config))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("export", "doctor"):
        from voicertc.export.cli import run

        return run(args)
    if args.command == "engine-serve":
        from voicertc.assemble import create_local_engine
        from voicertc.remote.cli import run as run_engine_serve

        return run_engine_serve(args, create_local_engine)
    try:
        config = resolve_config(args)
    except VoiceRTCError as exc:
        print(f"voicertc: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _run(config)
    except ConfigError as exc:  # a bad static_dir, a port in use: the message names the key
        print(f"voicertc: {exc}", file=sys.stderr)
        return 2
    except VoiceRTCError as exc:
        print(f"voicertc: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
