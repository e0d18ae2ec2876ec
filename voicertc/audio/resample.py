"""Streaming resampling of engine PCM to the 48 kHz the track sends. Runs on the engine thread.

One `StreamingResampler` per (utterance, input rate): soxr's stream keeps the filter state between
pieces, so chunked output equals one-shot output and chunk joins do not click. `flush()` returns the
filter's tail at the end of the utterance.
"""

from __future__ import annotations

import numpy as np
import soxr

OUTPUT_SAMPLE_RATE_HZ = 48000


class StreamingResampler:
    """float32 mono at `in_rate_hz` -> float32 mono at `out_rate_hz`; a passthrough when they match.

    State: soxr's filter history. Owned by one thread (the engine's); not thread-safe.
    """

    def __init__(
        self, in_rate_hz: int, out_rate_hz: int = OUTPUT_SAMPLE_RATE_HZ, quality: str = "HQ"
    ) -> None:
        if in_rate_hz <= 0 or out_rate_hz <= 0:
            raise ValueError(f"StreamingResampler: rates must be > 0, got {in_rate_hz} -> {out_rate_hz}")
        self.in_rate_hz = int(in_rate_hz)
        self.out_rate_hz = int(out_rate_hz)
        self._stream: soxr.ResampleStream | None = None
        if self.in_rate_hz != self.out_rate_hz:
            self._stream = soxr.ResampleStream(
                self.in_rate_hz, self.out_rate_hz, 1, dtype="float32", quality=quality
            )
        self._flushed = False

    @property
    def passthrough(self) -> bool:
        return self._stream is None

    def process(self, pcm: np.ndarray) -> np.ndarray:
        # pcm: [n_in] float32 at in_rate_hz -> [~n_in * out/in] float32 at out_rate_hz
        pcm = _as_mono_float32(pcm)
        if self._flushed:
            raise RuntimeError("StreamingResampler.process after flush(): use a new resampler per utterance")
        if self._stream is None:
            return pcm
        return self._stream.resample_chunk(pcm)

    def flush(self) -> np.ndarray:
        """The samples still inside the filter; call once at the end of the utterance."""
        if self._flushed or self._stream is None:
            self._flushed = True
            return np.zeros(0, dtype=np.float32)
        self._flushed = True
        return self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)


def _as_mono_float32(pcm: np.ndarray) -> np.ndarray:
    pcm = np.asarray(pcm)
    if pcm.ndim != 1:
        raise ValueError(f"expected 1-D mono PCM, got shape {pcm.shape}")
    return np.ascontiguousarray(pcm, dtype=np.float32)
