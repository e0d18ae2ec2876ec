"""`RingSink`: the engine's `AudioSink`, resampling onto a `PcmRing`. Written from the engine thread.

The sink does the per-piece CPU work (resample to 48 kHz, float -> int16) on the caller's thread so the
event loop only copies int16 frames out of the ring. Writes tagged with a generation older than the
ring's (an interrupt happened since the utterance opened) are dropped, resampler state included. An
utterance's first piece loses its leading near-silence (at most `trim_leading_ms`, see `trim.py`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from voicertc.audio.resample import StreamingResampler
from voicertc.audio.ring import PcmRing
from voicertc.audio.trim import leading_trim_samples

logger = logging.getLogger(__name__)

MAX_TEXT_MARKED_UTTERANCES = 64  # utterances whose text marks are kept for heard_text


@dataclass
class _UtteranceStream:
    sample_rate_hz: int
    generation: int
    resampler: StreamingResampler


class RingSink:
    """Implements `voicertc.engine.protocol.AudioSink` on top of a `PcmRing` (48 kHz mono int16).

    Owner: the engine thread calls write/end_utterance/has_room; the reader (track) owns the ring's
    read side and calls the space listener. `_streams` is touched by the engine thread only.
    """

    def __init__(self, ring: PcmRing, quality: str = "HQ", trim_leading_ms: float = 0.0) -> None:
        self.ring = ring
        self._quality = quality
        self.trim_leading_ms = trim_leading_ms
        self._streams: dict[str, _UtteranceStream] = {}
        # heard_text: per utterance, (48 kHz samples written before the text's audio, text)
        self._text_lock = threading.Lock()
        self._marks: OrderedDict[str, list[tuple[int, str]]] = OrderedDict()
        self._written: dict[str, int] = {}

    @property
    def generation(self) -> int:
        return self.ring.generation

    @property
    def queued_ms(self) -> float:
        return self.ring.queued_ms

    def has_room(self) -> bool:
        return self.ring.has_room()

    def set_space_listener(self, callback: Callable[[], None] | None) -> None:
        self.ring.set_space_listener(callback)

    def write(self, pcm: np.ndarray, sample_rate_hz: int, utterance_id: str, generation: int) -> bool:
        """Resample float32 mono PCM in [-1, 1] to 48 kHz and queue it. False (dropped) if stale."""
        if generation != self.ring.generation:
            self._streams.pop(utterance_id, None)
            return False
        if utterance_id not in self._streams and self.trim_leading_ms > 0:
            cut = leading_trim_samples(pcm, int(sample_rate_hz), self.trim_leading_ms)
            if cut:
                logger.debug("utterance %s: %d leading near-silent samples cut", utterance_id, cut)
                pcm = pcm[cut:]
        stream = self._stream_for(utterance_id, int(sample_rate_hz), generation)
        pcm_48k = stream.resampler.process(pcm)
        written = self.ring.write(float_to_int16(pcm_48k), utterance_id, generation)
        if written:
            self._written[utterance_id] = self._written.get(utterance_id, 0) + pcm_48k.size
        return written

    def mark_text(self, utterance_id: str, generation: int, text: str) -> None:
        """Engine thread: the audio written next for this utterance speaks `text` (SynthStep.text)."""
        if generation != self.ring.generation or not text:
            return
        with self._text_lock:
            marks = self._marks.get(utterance_id)
            if marks is None:
                marks = self._marks[utterance_id] = []
                while len(self._marks) > MAX_TEXT_MARKED_UTTERANCES:
                    self._marks.popitem(last=False)
            marks.append((self._written.get(utterance_id, 0), text))

    def heard_text(self, utterance_id: str | None, played_ms: float) -> str:
        """The text of every chunk of the utterance whose audio had started playing after `played_ms`
        (chunk granularity: what the backend marked). "" when nothing was marked or played."""
        if utterance_id is None or played_ms <= 0:
            return ""
        played = int(played_ms * self.ring.sample_rate_hz / 1000)
        with self._text_lock:
            marks = list(self._marks.get(utterance_id, ()))
        return " ".join(text for start, text in marks if start < played)

    def forget_text(self, utterance_id: str) -> None:
        with self._text_lock:
            self._marks.pop(utterance_id, None)

    def end_utterance(self, utterance_id: str, generation: int) -> None:
        """Flush the utterance's resampler into the ring and queue its end mark."""
        stream = self._streams.pop(utterance_id, None)
        self._written.pop(utterance_id, None)
        if generation != self.ring.generation:
            return
        if stream is not None and stream.generation == generation:
            tail = stream.resampler.flush()
            if tail.size and not self.ring.write(float_to_int16(tail), utterance_id, generation):
                return
        self.ring.end_utterance(utterance_id, generation)

    def abort_utterance(self, utterance_id: str, generation: int) -> None:
        """The utterance ends early (failed or cancelled): drop its resampler state, mark its end so
        playback stops counting it as playing once its queued audio has gone out."""
        self._streams.pop(utterance_id, None)
        self._written.pop(utterance_id, None)
        self.ring.end_utterance(utterance_id, generation)

    def _stream_for(self, utterance_id: str, sample_rate_hz: int, generation: int) -> _UtteranceStream:
        self._drop_stale(generation)
        stream = self._streams.get(utterance_id)
        if stream is not None and stream.sample_rate_hz != sample_rate_hz:
            # A new input rate mid-utterance: finish the old stream, start one for the new rate.
            logger.debug(
                "utterance %s: input rate %d -> %d Hz", utterance_id, stream.sample_rate_hz, sample_rate_hz
            )
            self.ring.write(float_to_int16(stream.resampler.flush()), utterance_id, generation)
            stream = None
        if stream is None:
            resampler = StreamingResampler(sample_rate_hz, self.ring.sample_rate_hz, quality=self._quality)
            stream = _UtteranceStream(sample_rate_hz, generation, resampler)
            self._streams[utterance_id] = stream
        return stream

    def _drop_stale(self, generation: int) -> None:
        stale = [uid for uid, s in self._streams.items() if s.generation != generation]
        for uid in stale:
            del self._streams[uid]


def float_to_int16(pcm: np.ndarray) -> np.ndarray:
    """float PCM in [-1, 1] (clipped) -> int16, rounded."""
    return np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)
