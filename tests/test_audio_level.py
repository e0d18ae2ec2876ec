"""The outgoing frames' RTP audio level: `voicertc.webrtc.audio_level` equals aiortc's own computation
for every frame (mono and stereo, 10 and 20 ms, silence to full scale), and calls install it."""

from __future__ import annotations

import numpy as np
from aiortc import rtp
from av import AudioFrame
from hypothesis import given, settings
from hypothesis import strategies as st

from voicertc.webrtc import audio_level


def frame(pcm: np.ndarray, layout: str) -> AudioFrame:
    out = AudioFrame.from_ndarray(pcm[None, :], format="s16", layout=layout)
    out.sample_rate = 48000
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([(480, "mono"), (960, "mono"), (480, "stereo"), (960, "stereo")]),
    st.integers(min_value=0, max_value=15),
    st.integers(min_value=0, max_value=2**32 - 1),
)
def test_equals_aiortcs_level_for_every_frame(shape, loudness_bits, seed):
    samples, layout = shape
    channels = 2 if layout == "stereo" else 1
    rng = np.random.default_rng(seed)
    peak = (1 << loudness_bits) - 1 if loudness_bits < 15 else 32767
    pcm = rng.integers(-peak - 1 if peak == 32767 else -peak, peak + 1, samples * channels).astype(np.int16)
    f = frame(pcm, layout)
    assert audio_level.audio_level_dbov(f) == audio_level.AIORTC_AUDIO_LEVEL(f)


def test_silence_full_scale_and_the_install():
    assert audio_level.audio_level_dbov(frame(np.zeros(1920, np.int16), "stereo")) == -127
    assert audio_level.audio_level_dbov(frame(np.full(1920, -32768, np.int16), "stereo")) == 0
    audio_level.install()
    assert rtp.compute_audio_level_dbov is audio_level.audio_level_dbov
    audio_level.install()  # idempotent
    assert audio_level.AIORTC_AUDIO_LEVEL is not audio_level.audio_level_dbov
