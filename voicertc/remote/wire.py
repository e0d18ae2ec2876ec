"""What crosses between a front-end and an engine replica: versions and message shapes.

A replica streams, per utterance: one `("open", header)`, then `("pcm", int16 bytes, rate_hz)` pieces
(mono, the engine's own rate), `("text", str)` marks (the text the PCM after it speaks) and exactly one
terminal `("event", {...})` ("done" | "failed" |
"cancelled"); messages that pile up on the replica travel together as `("batch", [messages])`.
The front-end sends text deltas, end of input and playout credit with `control` calls.
No Ray import here: the front-end's in-process mode and the tests' pure parts can use it.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import numpy as np

from voicertc import __version__

PROTOCOL = 3  # bumped when the messages below (or the replica's methods) change shape
DEPLOYMENT_NAME = "VoiceEngine"
ROUTER_CLASS = "voicertc.remote.router:SessionAffinityRouter"

Message = tuple[Any, ...]
_HOST = socket.gethostname()


def version_string(version: str = __version__, protocol: int = PROTOCOL) -> str:
    return f"voicertc {version} (remote protocol {protocol})"


def check_versions(
    engine: dict[str, Any], client_version: str = __version__, client_protocol: int = PROTOCOL
) -> str:
    """'' when the engine's info matches this front-end, else a message naming both versions."""
    theirs = (str(engine.get("version", "?")), int(engine.get("protocol", -1)))
    if theirs == (client_version, client_protocol):
        return ""
    return (
        f"version skew: the engine app runs {version_string(*theirs)}, this front-end "
        f"{version_string(client_version, client_protocol)}; deploy the same voicertc on both"
    )


def pcm_message(pcm: np.ndarray, sample_rate_hz: int) -> Message:
    """float PCM in [-1, 1] -> the int16 bytes that travel (half the bytes of float32), stamped with
    the replica's monotonic clock (same machine: the front-end measures the hop; else ignored)."""
    samples = np.round(np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0) * 32767.0).astype("<i2")
    return ("pcm", samples.tobytes(), int(sample_rate_hz), time.monotonic(), _HOST)


def pcm_from_message(data: bytes) -> np.ndarray:
    """int16 bytes -> float32 PCM in [-1, 1] (what `AudioSink.write` takes)."""
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0
