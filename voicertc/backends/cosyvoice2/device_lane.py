"""The engine thread's device context: a dedicated compute stream and PCM copies on a copy stream.

Runs on the engine thread. On CUDA, model work is queued on the lane's own compute stream (not the
default stream other code may use), and finished PCM is copied to pinned host memory on a second
stream that waits for the compute stream with an event; the engine then waits for that copy event only,
never for the whole device. On CPU the same calls are plain no-ops / copies, so one code path serves
both.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when available, else cpu; anything else as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class DeviceLane:
    """Compute stream + copy stream + events for one engine thread (owned by that thread)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.compute_stream = torch.cuda.Stream(device) if self.cuda else None
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Queue the model work of the block on the lane's compute stream."""
        if self.compute_stream is None:
            yield
            return
        with torch.cuda.stream(self.compute_stream):
            yield

    def to_host(self, pcm: Tensor) -> np.ndarray:
        """float32 host copy of `pcm`; on CUDA via the copy stream, waiting only for that copy."""
        if self.copy_stream is None or pcm.device.type != "cuda":
            return pcm.detach().to("cpu", torch.float32).numpy()
        assert self.compute_stream is not None
        produced = torch.cuda.Event()
        produced.record(self.compute_stream)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(produced)
            host = torch.empty(pcm.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(pcm.detach(), non_blocking=True)
            pcm.record_stream(self.copy_stream)  # keep the allocator from reusing it mid-copy
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        copied.synchronize()
        return host.numpy()
