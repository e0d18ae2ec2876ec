"""`server.voices` of the embedding API: the same registry operations as /v1/voices, in-process."""

from __future__ import annotations

import pytest
import torch
from audio_clips import clip
from cv2_engine_helpers import SFT_VOICE, build_speaking_model_dir

from signaling.embed import VoiceServer
from signaling.voice_admin import NotSupportedError
from voicertc.audio.decode import AudioError
from voicertc.config import config_from_dict
from voicertc.errors import UnknownVoiceError

torch.set_num_threads(2)


async def test_register_list_get_delete_in_process(tiny_model_dir, golden_dir, tmp_path):
    model_dir = build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path / "m")
    config = config_from_dict(
        {
            "server": {"port": 0},
            "engine": {
                "backend": "cosyvoice2",
                "model_dir": str(model_dir),
                "voices_dir": str(tmp_path / "v"),
            },
        }
    )
    async with VoiceServer(config) as server:
        (tmp_path / "clip.mp3").write_bytes(clip("mp3"))
        info = await server.voices.register(tmp_path / "clip.mp3", "Hello world.", voice_id="ann")
        assert info["id"] == "ann" and info["kind"] == "zero_shot"
        assert "ann" in server.engine.voices()  # usable at once by call.say(..., voice="ann")
        cross = await server.voices.register(clip("opus"), name="Quiet One")
        assert cross["kind"] == "cross_lingual" and cross["id"] == "quiet-one"
        assert [v["id"] for v in await server.voices.list()] == [SFT_VOICE, "ann", "quiet-one"]
        assert (await server.voices.get("ann"))["transcript"] == "Hello world."
        with pytest.raises(AudioError) as bad:
            await server.voices.register(clip("wav", seconds=0.4), "Hi.")
        assert bad.value.code == "audio_too_short"
        await server.voices.delete("ann")
        with pytest.raises(UnknownVoiceError):
            await server.voices.get("ann")


async def test_fake_engine_lists_and_refuses():
    async with VoiceServer(
        config_from_dict({"server": {"port": 0}, "engine": {"backend": "fake"}})
    ) as server:
        assert [v["id"] for v in await server.voices.list()] == ["tone", "silence"]
        with pytest.raises(NotSupportedError, match="not supported by this engine"):
            await server.voices.register(clip("wav"), "Hi.")
