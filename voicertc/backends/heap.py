"""Give freed heap memory back to the OS (glibc `malloc_trim`), where the C library has it.

onnxruntime frees its arena after each run (arena shrinkage), but glibc keeps freed pages of its
heap: after a long utterance RSS stayed 25-40 MB up until a trim returned it. A trim costs a few ms
(up to ~30 ms on a busy 2-core machine), so backends call it after long utterances, not every step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS): nothing to do
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def trim_heap() -> bool:
    """Return free heap pages to the OS; False where this C library cannot."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True
