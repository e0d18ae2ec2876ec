"""Transport-agnostic TTS engine: protocol, schedule, per-utterance state, the worker thread.

Importing this package must not import aiortc, aiohttp or torch (tests/test_boundaries.py).
"""

from voicertc.engine.protocol import (
    AudioSink,
    Cancelled,
    Done,
    Engine,
    EngineEvent,
    Failed,
    FirstAudio,
)
from voicertc.engine.schedule import ChunkSchedule

__all__ = [
    "AudioSink",
    "Cancelled",
    "ChunkSchedule",
    "Done",
    "Engine",
    "EngineEvent",
    "Failed",
    "FirstAudio",
]
