"""Outgoing frames that already have the Opus encoder's format skip aiortc's resampler. Encoder thread.

aiortc's `OpusEncoder.encode` passes every frame through an `av.AudioResampler` (an FFmpeg filter
graph) to get s16 stereo 48 kHz frames of 960 samples, then encodes them. `SpeechTrack` sends exactly
that (`[webrtc] stereo = true`, `frame_ms = 20`), so the graph only copies: in a py-spy profile of
silent two-way calls (2026-11-26) it cost as much as the Opus encode itself. `install()` makes such
frames go straight to the codec; any other frame (mono, 10 ms) takes aiortc's path, and an encoder
that once used its resampler keeps using it (the resampler may hold buffered samples). The packets
are the same bytes with the same timestamps (`tests/test_opus_send.py` against aiortc's own path).
"""

from __future__ import annotations

from typing import Any

from aiortc.codecs import opus

SAMPLES_PER_FRAME = opus.SAMPLES_PER_FRAME
SAMPLE_RATE_HZ = opus.SAMPLE_RATE

AIORTC_ENCODE = opus.OpusEncoder.encode  # kept for the equality test


def _ready(frame: Any) -> bool:
    """The frame is what the resampler would hand the codec: format, layout, rate, size and a pts in
    samples (the resampler re-times a frame without one, or with another time base)."""
    return bool(
        frame.format.name == "s16"
        and frame.layout.name == "stereo"
        and frame.sample_rate == SAMPLE_RATE_HZ
        and frame.samples == SAMPLES_PER_FRAME
        and frame.pts is not None
        and frame.time_base == opus.TIME_BASE
    )


def encode(self: Any, frame: Any, force_keyframe: bool = False) -> tuple[list[bytes], int | None]:
    """`OpusEncoder.encode` with no resampler for frames already in its format."""
    if getattr(self, "voicertc_resampling", False) or not _ready(frame):
        self.voicertc_resampling = True
        result: tuple[list[bytes], int | None] = AIORTC_ENCODE(self, frame, force_keyframe)
        return result
    packets = self.codec.encode(frame)
    if self.first_packet_pts is None and packets:
        self.first_packet_pts = packets[0].pts  # as aiortc: the encoder's first pts is negative
    if not packets:
        return [], None
    return [bytes(p) for p in packets], packets[0].pts - self.first_packet_pts


def install() -> None:
    """Make every aiortc Opus encoder use `encode` (idempotent)."""
    opus.OpusEncoder.encode = encode  # type: ignore[method-assign,assignment]
