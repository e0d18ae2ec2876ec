"""Host-made tensors onto the device without a stream sync (engine thread).

A captured step's small host-made inputs (row indices, positions, attention biases, gather indices)
are copied to the GPU while earlier work is still queued. A copy from pageable host memory may make the
driver wait for the stream first (it stages the bytes through pinned memory); from pinned memory it is
queued behind that work like a kernel, and torch's pinned-memory cache keeps the block until the copy
has run. On a CPU the tensor is moved as it is.
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """`host` (a CPU tensor) on `device`; to a GPU from pinned memory, queued without a stream sync."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def staged(host: Tensor, device: torch.device) -> Tensor:
    """`host` as the source of a non-blocking copy into a `device` tensor: pinned when `device` is a GPU."""
    return host.pin_memory() if device.type == "cuda" else host
