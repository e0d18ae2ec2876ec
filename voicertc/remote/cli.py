"""`voicertc engine-serve`: deploy the engine as a Ray Serve application (Ray imported only when run).

    voicertc engine-serve --config config.toml            # on a cluster node: deploy, serve until Ctrl-C
    voicertc engine-serve --config config.toml --detach   # deploy and leave it running in the cluster
    voicertc engine-serve --local --model fake            # a one-machine cluster on 127.0.0.1 (try-out)

The replicas run `engine.model` (or `engine.backend` when it names a model) with `[ray]`'s replica
count or autoscaling, CPUs and GPUs per replica. Front-ends reach it with `engine.backend = "ray"` and
the same `[ray] address / namespace / app_name`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from voicertc.config import BACKENDS, Config, load_config
from voicertc.engine.protocol import Engine
from voicertc.errors import VoiceRTCError


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cmd = commands.add_parser("engine-serve", help="deploy the speech engine as a Ray Serve application")
    cmd.add_argument("--config", help="config.toml (default: ./config.toml when present, else defaults)")
    cmd.add_argument("--address", help="Ray cluster address (ray.address)")
    cmd.add_argument("--app-name", help="Serve application name (ray.app_name)")
    cmd.add_argument("--model", choices=BACKENDS, help="model the replicas run (engine.model)")
    cmd.add_argument(
        "--model-dir", help="CosyVoice2 model directory on every replica node (engine.model_dir)"
    )
    cmd.add_argument("--replicas", type=int, help="replicas (ray.num_replicas)")
    cmd.add_argument("--num-gpus", type=float, help="GPUs per replica, fractions allowed (ray.num_gpus)")
    cmd.add_argument("--detach", action="store_true", help="deploy and exit; the app keeps running")
    cmd.add_argument(
        "--local", action="store_true", help="start a one-machine Ray cluster on 127.0.0.1 in this process"
    )
    cmd.add_argument(
        "--metrics-port",
        type=int,
        help="with --local: port of Ray's Prometheus endpoint (ray_voicertc_* metrics; default: Ray picks)",
    )


def engine_serve_config(args: argparse.Namespace) -> Config:
    """The config file (explicit, or ./config.toml) with the flags merged in, validated once: the
    flags are checked together (`--model cosyvoice2 --model-dir D`), a bad one named by its key."""
    path = args.config
    if path is None and Path("config.toml").is_file():
        path = "config.toml"
    ray = {
        k: v
        for k, v in (
            ("address", args.address),
            ("app_name", args.app_name),
            ("num_replicas", args.replicas),
            ("num_gpus", args.num_gpus),
        )
        if v is not None
    }
    engine: dict[str, Any] = {}
    if args.model is not None:
        engine.update(backend="ray", model=args.model)
    if args.model_dir is not None:
        engine["model_dir"] = args.model_dir
    overrides = {name: values for name, values in (("ray", ray), ("engine", engine)) if values}
    return load_config(path, overrides)


def run(args: argparse.Namespace, build_engine: Callable[[Config], Engine]) -> int:
    """Deploy; unless --detach, wait for SIGINT/SIGTERM and delete the app. Returns the exit status."""
    try:
        config = engine_serve_config(args)
    except VoiceRTCError as exc:
        print(f"voicertc: {exc}", file=sys.stderr)
        return 2
    if args.metrics_port is not None and not args.local:
        print(
            "voicertc: --metrics-port needs --local (on a cluster node: ray start --metrics-export-port N)",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=config.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        deploy(config, build_engine, local=args.local, metrics_port=args.metrics_port)
    except VoiceRTCError as exc:
        print(f"voicertc: {exc}", file=sys.stderr)
        return 1
    app = config.ray.app_name
    print(f"voicertc engine app {app!r} deployed (model {config.engine.model_name})", flush=True)
    if args.detach:
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    from ray import serve

    serve.delete(app)
    print(f"voicertc engine app {app!r} deleted", flush=True)
    return 0


def deploy(
    config: Config,
    build_engine: Callable[[Config], Engine],
    local: bool = False,
    metrics_port: int | None = None,
) -> None:
    """Connect (or with `local` start a loopback cluster), start Serve without HTTP proxies, deploy."""
    import ray
    from ray import serve

    from voicertc.remote.connect import apply_auth, connect_ray
    from voicertc.remote.deployment import build_app
    from voicertc.remote.loopback import loopback_init_options, not_a_cluster

    if local:
        apply_auth(config.ray)
        not_a_cluster()
        options = loopback_init_options()
        if metrics_port is not None:
            options["_metrics_export_port"] = metrics_port
        ray.init(namespace=config.ray.namespace, **options)
    else:
        connect_ray(config.ray)
    serve.start(proxy_location="Disabled")  # front-ends call replicas by handle; no HTTP ingress
    serve.run(build_app(config, build_engine), name=config.ray.app_name, route_prefix=None, blocking=False)
