"""Voice activity: a pure hysteresis state machine over per-window speech probabilities.

The model (Silero, see `models.SileroVad`) turns each 32 ms window of 16 kHz audio into a
probability; `VadStateMachine` turns probabilities into `SpeechStarted`/`SpeechStopped` with two
thresholds (voiced at `threshold`, unvoiced below `threshold - HYSTERESIS`), a minimum voiced time
before an onset counts and a minimum silence before speech ends. Times are media milliseconds on
the call's inbound timeline, so the machine is deterministic and clock-free.
"""

from __future__ import annotations

from dataclasses import dataclass

HYSTERESIS = 0.15  # below threshold - this, a window is unvoiced (between the two it keeps the state)
ONSET_GAP_WINDOWS = 2  # unvoiced windows in a row that abandon an onset not yet confirmed


@dataclass(frozen=True)
class SpeechStarted:
    at_ms: float  # media time of the first voiced window of the segment
    confirmed_ms: float  # media time the onset was confirmed (min_speech_ms voiced)


@dataclass(frozen=True)
class SpeechStopped:
    at_ms: float  # media time of the segment's onset
    end_ms: float  # media time the last voiced window ended
    confirmed_ms: float  # media time the end was confirmed (min_silence_ms unvoiced)

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.at_ms


VadEvent = SpeechStarted | SpeechStopped


class VadStateMachine:
    """silence -> (onset) -> speaking -> (min_silence_ms unvoiced) -> silence. Pure; one per stream.

    Invariants: events alternate Started, Stopped, Started, ...; a Started needs `min_speech_ms` of
    voiced windows with no unvoiced run of `ONSET_GAP_WINDOWS`; a Stopped needs `min_silence_ms`
    of unvoiced windows (the latch released below the low threshold), and reports as the end the
    last window at or above `threshold` (Silero's probability decays slowly after the last word).
    """

    def __init__(self, threshold: float, min_speech_ms: float, min_silence_ms: float) -> None:
        self.threshold = threshold
        self.low_threshold = max(0.01, threshold - HYSTERESIS)
        self.min_speech_ms = min_speech_ms
        self.min_silence_ms = min_silence_ms
        self.speaking = False
        self._onset_ms: float | None = None  # candidate or confirmed onset
        self._voiced_ms = 0.0  # voiced time since the candidate onset
        self._gap_windows = 0  # unvoiced windows in a row during a candidate onset
        self._last_voiced_end_ms = 0.0
        self._last_strong_end_ms = 0.0  # end of the last window at or above `threshold` (the reported end)
        self._voiced_state = False  # the hysteresis latch

    @property
    def onset_ms(self) -> float | None:
        return self._onset_ms

    @property
    def idle(self) -> bool:
        """Silent, no onset pending and the latch released: a window that is not voiced cannot change
        anything but the silence it extends (an unvoiced window then leaves the machine as it was)."""
        return not self.speaking and self._onset_ms is None and not self._voiced_state

    def _voiced(self, prob: float) -> bool:
        if prob >= self.threshold:
            self._voiced_state = True
        elif prob < self.low_threshold:
            self._voiced_state = False
        return self._voiced_state

    def update(self, prob: float, start_ms: float, end_ms: float) -> VadEvent | None:
        """One window [start_ms, end_ms) with speech probability `prob`; an event when one happens."""
        voiced = self._voiced(prob)
        if self.speaking:
            if prob >= self.threshold:
                self._last_strong_end_ms = end_ms
            return self._while_speaking(voiced, end_ms)
        return self._while_silent(voiced, start_ms, end_ms)

    def _while_silent(self, voiced: bool, start_ms: float, end_ms: float) -> VadEvent | None:
        if voiced:
            if self._onset_ms is None:
                self._onset_ms = start_ms
                self._voiced_ms = 0.0
            self._gap_windows = 0
            self._voiced_ms += end_ms - start_ms
            self._last_voiced_end_ms = end_ms
            self._last_strong_end_ms = end_ms
            if self._voiced_ms >= self.min_speech_ms:
                self.speaking = True
                return SpeechStarted(at_ms=self._onset_ms, confirmed_ms=end_ms)
        elif self._onset_ms is not None:
            self._gap_windows += 1
            if self._gap_windows >= ONSET_GAP_WINDOWS:
                self._onset_ms = None
                self._voiced_ms = 0.0
        return None

    def _while_speaking(self, voiced: bool, end_ms: float) -> VadEvent | None:
        if voiced:
            self._last_voiced_end_ms = end_ms
            return None
        if end_ms - self._last_voiced_end_ms >= self.min_silence_ms:
            onset = self._onset_ms if self._onset_ms is not None else self._last_voiced_end_ms
            self.speaking = False
            self._onset_ms = None
            self._voiced_ms = 0.0
            self._gap_windows = 0
            end = max(onset, min(self._last_strong_end_ms, self._last_voiced_end_ms))
            return SpeechStopped(at_ms=onset, end_ms=end, confirmed_ms=end_ms)
        return None
