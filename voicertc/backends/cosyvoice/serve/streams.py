"""`token2wav_stream(model, voice)`: a per-utterance token -> PCM stream for either model version.

Runs on the engine thread (or a test's). The voice's cached prompt state is cloned, never shared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from voicertc.backends.cosyvoice.hift.causal import CausalHiFTGenerator
from voicertc.backends.cosyvoice.load.v3 import CosyVoice3Model
from voicertc.backends.cosyvoice.serve.token2wav import Token2WavStream, open_stream
from voicertc.backends.cosyvoice.serve.token2wav_v3 import open_stream_v3
from voicertc.engine.schedule import ChunkSchedule

if TYPE_CHECKING:
    from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
    from voicertc.backends.cosyvoice.voice.voices import Voice


def token2wav_stream(
    model: CosyVoice2Model, voice: Voice, schedule: ChunkSchedule | None = None, **options: Any
) -> Token2WavStream:
    """A fresh stream on `voice` (default `ChunkSchedule()`); v3 models get `Token2WavStreamV3`."""
    schedule = schedule or ChunkSchedule()
    prompt = (voice.flow_prompt_tokens, voice.prompt_feat, voice.embedding)
    if isinstance(model, CosyVoice3Model):
        if not isinstance(model.hift, CausalHiFTGenerator):  # the v2 field type; `load` puts v3's there
            raise TypeError(f"a CosyVoice3 model needs a CausalHiFTGenerator, not {type(model.hift)}")
        return open_stream_v3(model.flow, model.hift, voice.flow_state, prompt, schedule, **options)
    if schedule.final_chunk == "reference" or options.get("speed", 1.0) != 1.0:
        options.setdefault("reference_prompt", prompt)
    return open_stream(model.flow, model.hift, voice.flow_state, voice.prompt_tokens, schedule, **options)
