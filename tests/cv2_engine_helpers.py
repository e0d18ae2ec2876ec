"""A tiny CosyVoice2 directory the engine can speak from: `bench.make_tiny_model_dir` (the golden tiny
checkpoints, a tiny BPE tokenizer, tiny ONNX speech tokenizer / CAM++, a one-speaker spk2info.pt and an
llm.pt whose decoder only says the tiny flow's 512 ids), with eos left as the random weights score it so
an utterance's length is set by the test's token cap."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.make_tiny_model_dir import SFT_VOICE as SFT_VOICE  # noqa: E402 - re-exported
from bench.make_tiny_model_dir import make_tiny_model_dir  # noqa: E402
from voicertc.audio.decode import Clip  # noqa: E402
from voicertc.backends.cosyvoice.load import load_v2 as load  # noqa: E402
from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model  # noqa: E402
from voicertc.backends.cosyvoice.serve.backend import BackendOptions, CosyVoice2Backend  # noqa: E402
from voicertc.backends.cosyvoice.serve.token2wav import Token2WavStream  # noqa: E402
from voicertc.backends.cosyvoice.voice.voices import Voice, voice_from_features  # noqa: E402

GOLDEN_VOICE = "golden"


def build_speaking_model_dir(tiny_model_dir: Path, golden_dir: Path, out: Path) -> Path:
    """The speaking directory in `out`, its checkpoints copied from the session's tiny directory.

    eos keeps its random score: it is banned below 2x the text tokens and then rarely sampled, so the
    tests' `max_segment_tokens` caps decide how long an utterance is."""
    del golden_dir  # the builder reads the golden files itself
    return make_tiny_model_dir(out, eos_at_min_len=False, checkpoints_from=tiny_model_dir)


def load_speaking_model(model_dir: Path) -> CosyVoice2Model:
    """Load it (the decoder's vocabulary is restricted on disk by the builder, not here)."""
    return load(model_dir)


def golden_voice(model: CosyVoice2Model, golden_dir: Path, voice_id: str = GOLDEN_VOICE) -> Voice:
    """The golden flow prompt (17 tokens, 34 frames) as a voice without an LLM prompt."""
    tts = load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")
    return voice_from_features(
        model, tts["in_prompt_token"], tts["in_prompt_feat"], tts["in_embedding"], voice_id=voice_id
    )


def make_backend(
    model: CosyVoice2Model, golden_dir: Path, voices_dir: Path | None = None, **options: object
) -> CosyVoice2Backend:
    defaults: dict[str, object] = {"seed": 1234, "max_segment_tokens": 80}
    backend = CosyVoice2Backend(
        model,
        voices_dir=voices_dir,
        options=BackendOptions(**{**defaults, **options}),  # type: ignore[arg-type]
    )
    backend.add_voice(golden_voice(model, golden_dir), persist=False)
    return backend


def tone_clip(seconds: float, pitch_hz: float) -> Clip:
    """A voiced-sounding prompt clip at 16 kHz (a tone with a 3 Hz tremolo), for registering voices."""
    rate = 16000
    t = np.arange(int(seconds * rate)) / rate
    wav = 0.3 * np.sin(2 * np.pi * pitch_hz * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return Clip(samples=wav.astype(np.float32), sample_rate_hz=rate)


def record_speech_tokens(monkeypatch) -> dict[int, list[int]]:
    """Every speech token a token2wav stream takes, by stream (filled as the engine speaks)."""
    seen: dict[int, list[int]] = {}
    original = Token2WavStream.add_tokens

    def add_tokens(self, tokens):
        seen.setdefault(id(self), []).extend(int(t) for t in tokens)
        return original(self, tokens)

    monkeypatch.setattr(Token2WavStream, "add_tokens", add_tokens)
    return seen
