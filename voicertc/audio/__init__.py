"""The audio path between engine and transport: resample, queue, fade. No torch, aiortc or aiohttp here."""

from __future__ import annotations

from voicertc.audio.fade import FadeShape, fade_in, fade_in_gain, fade_out, fade_out_gain
from voicertc.audio.resample import OUTPUT_SAMPLE_RATE_HZ, StreamingResampler
from voicertc.audio.ring import RING_SAMPLE_RATE_HZ, PcmRead, PcmRing, RingOverflowError, Span
from voicertc.audio.sink import RingSink, float_to_int16

__all__ = [
    "OUTPUT_SAMPLE_RATE_HZ",
    "RING_SAMPLE_RATE_HZ",
    "FadeShape",
    "PcmRead",
    "PcmRing",
    "RingOverflowError",
    "RingSink",
    "Span",
    "StreamingResampler",
    "fade_in",
    "fade_in_gain",
    "fade_out",
    "fade_out_gain",
    "float_to_int16",
]
