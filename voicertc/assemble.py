"""The composition root: `create_engine(config)` builds the engine the config names (fake | piper |
cosyvoice2 | cosyvoice3 in-process, or the Ray client), ready to `start()`; nothing below imports it.

The backend itself (model loading, onnxruntime sessions, a CUDA context) is built on the engine's
worker thread when it starts, never on the caller's thread (the event loop).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from voicertc.config import Config
from voicertc.engine.backend import AnyBackend
from voicertc.engine.pool import EnginePool
from voicertc.engine.protocol import Engine
from voicertc.engine.worker import EngineWorker
from voicertc.errors import ConfigError


def backend_factory(config: Config) -> Callable[[], AnyBackend]:
    """A function that builds the configured backend (called on the worker thread)."""
    kind = config.engine.model_name
    if kind == "fake":
        from voicertc.engine.fake import FakeBackend

        return lambda: FakeBackend(config.fake)
    if kind == "piper":
        try:
            from voicertc.backends.piper import PiperBackend
        except ImportError as exc:
            raise ConfigError(f"engine model 'piper' needs the cpu-voice extra: {exc}") from exc
        return lambda: PiperBackend(
            threads=config.engine.piper_threads,
            first_clause_min_chars=config.engine.first_clause_min_chars,
            max_step_ms=config.engine.max_step_ms,
            piece_phonemes=config.engine.piper_piece_phonemes,
        )
    create: Callable[[Config], AnyBackend]
    try:
        if kind == "cosyvoice3":
            from voicertc.backends.cosyvoice.serve.backend_v3 import create_backend as create_v3

            create = create_v3
        else:
            from voicertc.backends.cosyvoice.serve.backend import create_backend as create_v2

            create = create_v2
    except ImportError as exc:
        raise ConfigError(f"engine model {kind!r} needs the cosyvoice extra: {exc}") from exc
    return lambda: create(config)


def create_engine(config: Config, *, local: bool = False) -> Engine:
    """An EngineWorker for the configured model, or a pool of `engine.workers` of them (not
    started; `start()` builds the backends, each on its own worker thread, and waits for them).

    With `engine.backend = "ray"` (and not `local`, which a replica asks for) it is the client of the
    remote engine deployment instead (`voicertc.remote`, needs the `scale` extra)."""
    if config.engine.remote and not local:
        try:
            from voicertc.remote.client import RemoteEngine
        except ImportError as exc:
            raise ConfigError(
                f"engine.backend = 'ray' needs the scale extra (pip install voicertc[scale]): {exc}"
            ) from exc
        return RemoteEngine(config)
    build = backend_factory(config)
    model = config.engine.model_name
    workers = [
        EngineWorker(
            backend_factory=build,
            name=model if config.engine.workers == 1 else f"{model}-{i}",
            default_voice=config.engine.default_voice,
            max_text_chars=config.limits.max_text_chars,
            max_utterances=config.limits.max_utterances,
            max_step_ms=config.engine.max_step_ms,
            max_utterance_s=config.limits.max_utterance_s,
            max_batch=config.engine.max_batch,
        )
        for i in range(config.engine.workers)
    ]
    if len(workers) == 1:
        return workers[0]
    return EnginePool(workers, max_utterances=config.limits.max_utterances)


def create_local_engine(config: Config) -> Engine:
    """The in-process engine of `config` whatever `engine.backend` says (what a Ray replica runs)."""
    return create_engine(config, local=True)


def app_builder(args: dict[str, str]) -> Any:
    """`serve run voicertc.assemble:app_builder config=config.toml` (config optional)."""
    from voicertc.config import load_config
    from voicertc.remote.deployment import build_app

    path = args.get("config")
    return build_app(load_config(Path(path) if path else None), create_local_engine)
