"""Outgoing frames that already have the Opus encoder's format skip aiortc's resampler. Encoder thread.

aiortc's `OpusEncoder.encode` passes every frame through an `av.AudioResampler` (an FFmpeg filter
graph) to get s16 stereo 48 kHz frames of 960 samples, then encodes them. `SpeechTrack` sends exactly
that (`[webrtc] stereo = true`, `frame_ms = 20`), so the graph only copies: in a py-spy profile of
silent two-way calls (2026-11-26) it cost as much as the Opus encode itself. `install()` makes such
frames go straight to the codec; any other frame (mono, 10 ms) takes aiortc's path, and an encoder
that once used its resampler keeps using it (the resampler may hold buffered samples). The packets
are the same bytes with the same timestamps (`tests/test_opus_send.py` against aiortc's own path).

Silence: for digital silence the encoder settles within a few frames on one 3-byte packet. A track that
has sent some silent frames may hand the sender that packet instead (`silence_payload`,
`silence_packet`; aiortc packs a packet on the loop, with no encoder thread hop and no encode): the
RTP stream carries the same bytes with the same timestamps during the silence. The encoder does not
see those frames, so the first packets after the silence may differ in their last bits from a stream
that encoded it (its analysis history is shorter); they decode to the sent speech with the same
fidelity (within 0.5 dB SNR, tested).
"""

from __future__ import annotations

import functools
from typing import Any

import av
import numpy as np
from aiortc.codecs import opus

SAMPLES_PER_FRAME = opus.SAMPLES_PER_FRAME
SAMPLE_RATE_HZ = opus.SAMPLE_RATE

AIORTC_ENCODE = opus.OpusEncoder.encode  # kept for the equality test
SILENCE_PROBE_FRAMES = 4  # digital-silence frames a fresh encoder is given to find its silence packet


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


def _timestamp(self: Any, pts: int) -> int:
    """RTP timestamp of a frame or packet at `pts` samples: from the first one sent (aiortc's origin),
    so frames and pre-encoded packets (`pack`) share one timeline."""
    origin = getattr(self, "voicertc_origin", None)
    if origin is None:
        origin = self.voicertc_origin = pts
    return int(pts - origin)


def encode(self: Any, frame: Any, force_keyframe: bool = False) -> tuple[list[bytes], int | None]:
    """`OpusEncoder.encode` with no resampler for frames already in its format."""
    if getattr(self, "voicertc_resampling", False) or not _ready(frame):
        self.voicertc_resampling = True
        result: tuple[list[bytes], int | None] = AIORTC_ENCODE(self, frame, force_keyframe)
        return result
    packets = self.codec.encode(frame)
    if not packets:
        return [], None
    # one 20 ms frame in, its packet out (Opus's look-ahead is in the packets' pts, not in a delay):
    # the frame's own pts is aiortc's packets[0].pts - first_packet_pts, and stays right when the
    # encoder did not see the silence sent as packets in between
    return [bytes(p) for p in packets], _timestamp(self, frame.pts)


def pack(self: Any, packet: Any) -> tuple[list[bytes], int]:
    """`OpusEncoder.pack` (a pre-encoded packet, on the event loop) on the same timeline as `encode`."""
    return [bytes(packet)], _timestamp(self, int(packet.pts))


@functools.cache
def silence_payload() -> bytes | None:
    """The packet aiortc's Opus encoder settles on for digital silence (20 ms stereo 48 kHz frames), or
    None when it does not settle on one (then silence is encoded like any frame)."""
    encoder = opus.OpusEncoder()
    payloads = []
    for index in range(SILENCE_PROBE_FRAMES):
        frame = av.AudioFrame.from_ndarray(
            np.zeros((1, 2 * SAMPLES_PER_FRAME), dtype=np.int16), format="s16", layout="stereo"
        )
        frame.sample_rate = SAMPLE_RATE_HZ
        frame.pts = index * SAMPLES_PER_FRAME
        frame.time_base = opus.TIME_BASE
        encoded, _ = encode(encoder, frame)
        payloads.extend(encoded)
    settled = len(payloads) >= 2 and payloads[-1] == payloads[-2]
    return payloads[-1] if settled else None


def silence_packet(payload: bytes, pts: int) -> av.Packet:
    """A pre-encoded silent 20 ms frame at `pts` samples, for a track to hand aiortc's sender."""
    packet = av.Packet(payload)
    packet.pts = pts
    packet.time_base = opus.TIME_BASE
    return packet


def install() -> None:
    """Make every aiortc Opus encoder use `encode` and `pack` (idempotent)."""
    opus.OpusEncoder.encode = encode  # type: ignore[method-assign,assignment]
    opus.OpusEncoder.pack = pack  # type: ignore[method-assign]
