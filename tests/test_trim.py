"""Leading-silence trim: the onset search (pure) and the sink cutting only an utterance's first piece."""

from __future__ import annotations

import numpy as np
import pytest

from voicertc.audio import PcmRing, RingSink
from voicertc.audio.trim import LEAD_IN_MS, leading_trim_samples

SR = 48000


def _speech_after(silence_ms: float, level: float = 1e-3, tone_ms: float = 100.0) -> np.ndarray:
    rng = np.random.default_rng(0)
    quiet = rng.uniform(-level, level, int(SR * silence_ms / 1000)).astype(np.float32)
    t = np.arange(int(SR * tone_ms / 1000)) / SR
    tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    tone[0] = 0.3  # the onset sample is exactly where the quiet part ends
    return np.concatenate([quiet, tone])


@pytest.mark.parametrize("silence_ms", [0.0, 5.0, 10.0, 50.0, 99.0])
def test_cut_keeps_the_lead_in_before_the_onset(silence_ms):
    pcm = _speech_after(silence_ms)
    cut = leading_trim_samples(pcm, SR, max_trim_ms=200.0)
    expected = max(0, int(SR * silence_ms / 1000) - int(SR * LEAD_IN_MS / 1000))
    assert cut == expected
    assert np.abs(pcm[:cut]).max(initial=0.0) <= 1e-3  # only near-silence is dropped


def test_cut_never_exceeds_the_cap_and_off_means_off():
    long_pause = _speech_after(400.0)
    assert leading_trim_samples(long_pause, SR, max_trim_ms=100.0) == SR // 10
    silent = np.zeros(SR // 20, np.float32)  # 50 ms of silence only
    assert leading_trim_samples(silent, SR, max_trim_ms=100.0) == SR // 20 - int(SR * LEAD_IN_MS / 1000)
    assert leading_trim_samples(long_pause, SR, max_trim_ms=0.0) == 0
    assert leading_trim_samples(np.zeros(0, np.float32), SR, max_trim_ms=100.0) == 0
    loud = _speech_after(60.0, level=0.05)  # a quiet part above -50 dBFS is speech: nothing is cut
    assert leading_trim_samples(loud, SR, max_trim_ms=100.0) == 0


def test_sink_trims_only_the_first_piece_of_each_utterance():
    ring = PcmRing(high_water_ms=4000.0, margin_ms=500.0)
    sink = RingSink(ring, trim_leading_ms=100.0)
    first = _speech_after(50.0)
    assert sink.write(first, SR, "a", sink.generation)
    assert sink.write(_speech_after(50.0), SR, "a", sink.generation)  # a pause inside: kept
    sink.end_utterance("a", sink.generation)
    a = ring.read(100_000).pcm
    cut = int(SR * 0.05) - int(SR * LEAD_IN_MS / 1000)
    assert abs(len(a) - (2 * len(first) - cut)) <= 2
    assert sink.write(_speech_after(50.0), SR, "b", sink.generation)  # the next utterance is trimmed too
    sink.end_utterance("b", sink.generation)
    assert abs(len(ring.read(100_000).pcm) - (len(first) - cut)) <= 2
    untrimmed = RingSink(PcmRing(), trim_leading_ms=0.0)
    assert untrimmed.write(first, SR, "c", untrimmed.generation)
    untrimmed.end_utterance("c", untrimmed.generation)
    assert abs(len(untrimmed.ring.read(100_000).pcm) - len(first)) <= 2
