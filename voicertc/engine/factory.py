"""create_engine(config): the engine the config names, ready to `start()`."""

from __future__ import annotations

from voicertc.config import Config
from voicertc.engine.worker import EngineWorker


def create_engine(config: Config) -> EngineWorker:
    """Build the configured backend behind an EngineWorker (not started)."""
    kind = config.engine.backend
    if kind == "fake":
        from voicertc.engine.fake import FakeBackend

        backend = FakeBackend(config.fake)
    elif kind == "piper":
        from voicertc.backends.piper import PiperBackend

        backend = PiperBackend(
            threads=config.engine.piper_threads,
            first_clause_min_chars=config.engine.first_clause_min_chars,
        )
    else:
        from voicertc.backends.cosyvoice2.engine_backend import create_backend

        backend = create_backend(config)
    return EngineWorker(
        backend,  # type: ignore[arg-type]
        default_voice=config.engine.default_voice,
        max_text_chars=config.limits.max_text_chars,
        max_utterances=config.limits.max_utterances,
    )
