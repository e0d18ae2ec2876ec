"""FakeEngine: the real engine worker with a backend that makes a tone (or silence) on a timetable.

For transport, signaling and browser tests without models. Knobs (`[fake]` in config.toml): time to
first audio, real-time factor, chunk length, tone frequency, fail after N chunks, and a voice book
(voices registered in memory, `fake_voices.py`). The timetable is
kept by `wake_at`, so the worker waits on its queue with a deadline instead of sleeping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from voicertc.config import FakeConfig
from voicertc.engine.backend import SynthStep
from voicertc.engine.fake_voices import FakeVoiceBook
from voicertc.engine.text_chunks import has_speech, next_text_chunk
from voicertc.engine.utterance import Utterance
from voicertc.engine.voice_book import BackendVoiceBook
from voicertc.engine.worker import EngineWorker

SAMPLE_RATE_HZ = 24_000
MS_PER_CHAR = 65.0  # roughly conversational speaking rate
AMPLITUDE = 0.3


@dataclass
class _FakeState:
    chunks_done: int = 0
    remaining_samples: int = 0
    next_ready_s: float | None = None
    phase: float = 0.0
    first_chunk_taken: bool = False
    queued_samples: int = 0  # samples of every chunk taken so far
    produced_samples: int = 0
    texts: list[tuple[int, str]] = field(default_factory=list)  # (start sample, chunk text) not yet sent

    @staticmethod
    def of(utt: Utterance) -> _FakeState:
        """`utt`'s state, set by `begin`."""
        state = utt.backend_state
        if not isinstance(state, _FakeState):
            raise RuntimeError(f"utterance {utt.utterance_id} has no fake-engine state")
        return state


BUILTIN_VOICES = ["tone", "silence"]


class FakeBackend:
    name = "fake"
    features: frozenset[str] = frozenset()  # no instruct, no speed

    def __init__(self, config: FakeConfig | None = None) -> None:
        self.config = config or FakeConfig()
        self.chunk_samples = SAMPLE_RATE_HZ * self.config.chunk_ms // 1000
        # `[fake] voice_book`: registered voices in memory (spoken with the tone); else built-in only
        self.book = FakeVoiceBook(BUILTIN_VOICES) if self.config.voice_book else None
        self.voice_book: BackendVoiceBook | None = self.book

    def voices(self) -> list[str]:
        """Any thread (a snapshot)."""
        return self.book.ids() if self.book is not None else list(BUILTIN_VOICES)

    def begin(self, utt: Utterance) -> None:
        utt.backend_state = _FakeState()

    def _take_text(self, utt: Utterance) -> None:
        state = _FakeState.of(utt)
        while True:
            split = next_text_chunk(utt.text, input_ended=utt.input_ended, first=not state.first_chunk_taken)
            if split is None:
                return
            chunk, utt.text = split
            state.first_chunk_taken = True
            if has_speech(chunk):
                samples = int(SAMPLE_RATE_HZ * MS_PER_CHAR * len(chunk) / 1000)
                state.texts.append((state.queued_samples, chunk))
                state.queued_samples += samples
                state.remaining_samples += samples

    def has_work(self, utt: Utterance, now_s: float) -> bool:
        self._take_text(utt)
        state = _FakeState.of(utt)
        if state.remaining_samples > 0:
            if state.next_ready_s is None:
                state.next_ready_s = (utt.first_text_s or now_s) + self.config.ttfa_ms / 1000.0
            return now_s >= state.next_ready_s
        return utt.input_ended and not utt.text.strip()

    def wake_at(self, utt: Utterance) -> float | None:
        state = _FakeState.of(utt)
        return state.next_ready_s if state.remaining_samples > 0 else None

    def step(self, utt: Utterance, now_s: float) -> SynthStep:
        state = _FakeState.of(utt)
        if state.remaining_samples <= 0:
            return SynthStep(done=True)
        if 0 <= self.config.fail_after_chunks <= state.chunks_done:
            raise RuntimeError(f"fake engine failure after {state.chunks_done} chunks")
        n = min(self.chunk_samples, state.remaining_samples)
        pcm = self._tone(state, n) if utt.voice != "silence" else np.zeros(n, np.float32)
        state.remaining_samples -= n
        end = state.produced_samples + n
        text = " ".join(t for start, t in state.texts if start < end)
        state.texts = [(start, t) for start, t in state.texts if start >= end]
        state.produced_samples = end
        state.chunks_done += 1
        state.next_ready_s = max(now_s, state.next_ready_s or now_s) + self.config.rtf * n / SAMPLE_RATE_HZ
        done = state.remaining_samples <= 0 and utt.input_ended and not utt.text.strip()
        return SynthStep(pcm=[pcm], sample_rate_hz=SAMPLE_RATE_HZ, done=done, text=text)

    def _tone(self, state: _FakeState, n: int) -> np.ndarray:
        step = 2 * math.pi * self.config.tone_hz / SAMPLE_RATE_HZ
        phases = state.phase + step * np.arange(n)
        state.phase = float((state.phase + step * n) % (2 * math.pi))
        return (AMPLITUDE * np.sin(phases)).astype(np.float32)

    def release(self, utt: Utterance) -> None:
        utt.backend_state = None

    def close(self) -> None:
        pass


class FakeEngine(EngineWorker):
    """EngineWorker over FakeBackend: same protocol as the real engines."""

    def __init__(self, config: FakeConfig | None = None, **worker_kwargs: object) -> None:
        super().__init__(FakeBackend(config), **worker_kwargs)  # type: ignore[arg-type]
