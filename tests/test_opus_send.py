"""Outgoing Opus: frames in the encoder's own format skip aiortc's resampler and come out as the same
packets with the same timestamps; any other frame (mono, 10 ms) takes aiortc's path for good."""

from __future__ import annotations

import fractions

import numpy as np
from aiortc.codecs import opus
from av import AudioFrame

from voicertc.webrtc import opus_send

TIME_BASE = fractions.Fraction(1, 48000)


def frames(n: int, samples: int, layout: str, seed: int = 0) -> list[AudioFrame]:
    rng = np.random.default_rng(seed)
    channels = 2 if layout == "stereo" else 1
    out = []
    t = np.arange(n * samples) / 48000
    tone = (8000 * np.sin(2 * np.pi * 220 * t) + rng.normal(0, 300, t.size)).astype(np.int16)
    for i in range(n):
        pcm = np.repeat(tone[i * samples : (i + 1) * samples], channels)
        frame = AudioFrame.from_ndarray(pcm[None, :], format="s16", layout=layout)
        frame.sample_rate, frame.pts, frame.time_base = 48000, i * samples, TIME_BASE
        out.append(frame)
    return out


def encoded(encode, batch: list[AudioFrame]) -> list[tuple[list[bytes], int | None]]:
    encoder = opus.OpusEncoder()
    return [encode(encoder, frame) for frame in batch]


def test_track_frames_encode_to_the_same_packets_without_the_resampler():
    batch = frames(50, 960, "stereo")
    ours = encoded(opus_send.encode, batch)
    theirs = encoded(opus_send.AIORTC_ENCODE, batch)
    assert ours == theirs
    assert sum(len(payloads) for payloads, _ in ours) >= 49 and ours[-1][1] is not None


def test_other_frames_take_aiortcs_path_for_good():
    for samples, layout in ((480, "stereo"), (960, "mono")):
        batch = frames(40, samples, layout)
        assert encoded(opus_send.encode, batch) == encoded(opus_send.AIORTC_ENCODE, batch)
    other_clock = frames(10, 960, "stereo")
    for i, frame in enumerate(other_clock):
        frame.pts, frame.time_base = 2 * 960 * i, fractions.Fraction(1, 96000)  # the resampler re-times it
    assert encoded(opus_send.encode, other_clock) == encoded(opus_send.AIORTC_ENCODE, other_clock)
    encoder = opus.OpusEncoder()
    opus_send.encode(encoder, frames(1, 480, "stereo")[0])  # half a frame now buffered in the resampler
    assert encoder.voicertc_resampling
    assert opus_send.encode(encoder, frames(2, 960, "stereo")[1])[0]  # still resampled: nothing lost


def test_install_is_idempotent():
    opus_send.install()
    opus_send.install()
    assert opus.OpusEncoder.encode is opus_send.encode
