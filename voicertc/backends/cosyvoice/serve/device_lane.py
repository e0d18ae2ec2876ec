"""The engine thread's device context: a dedicated compute stream and PCM copies on a copy stream.

Runs on the engine thread. On CUDA, model work is queued on the lane's own compute stream (not the
default stream other code may use), and finished PCM is copied to pinned host memory on a second
stream that waits for the compute stream with an event; the engine then waits for that copy event only,
never for the whole device, and only after it has queued every row's copy (`to_host_async`). On CPU
the same calls are plain no-ops / copies, so one code path serves both.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

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
        return self.to_host_async(pcm)()

    def to_host_async(self, pcm: Tensor) -> Callable[[], np.ndarray]:
        """Queue the host copy of `pcm` and return a wait for it: on CUDA the copy runs on the copy
        stream behind the compute that produced `pcm` while the engine queues more work; the returned
        callable waits for this copy's event only. On CPU the copy is made now."""
        if self.copy_stream is None or pcm.device.type != "cuda":
            host = pcm.detach().to("cpu", torch.float32).numpy()
            return lambda: host
        assert self.compute_stream is not None
        produced = torch.cuda.Event()
        produced.record(self.compute_stream)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(produced)
            pinned = torch.empty(pcm.shape, dtype=torch.float32, pin_memory=True)
            pinned.copy_(pcm.detach(), non_blocking=True)
            pcm.record_stream(self.copy_stream)  # keep the allocator from reusing it mid-copy
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)

        def wait() -> np.ndarray:
            copied.synchronize()
            return pinned.numpy()

        return wait
