"""/v1/voices on the tiny CosyVoice2 directory (real engine, real PyAV clips) and on Piper."""

from __future__ import annotations

import base64
import contextlib
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from audio_clips import clip
from call_helpers import PeerClient
from cv2_engine_helpers import SFT_VOICE, build_speaking_model_dir

from signaling.app import create_app
from voicertc.config import config_from_dict
from voicertc.webrtc import patch_aioice_loopback

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


@pytest.fixture(scope="module")
def speaking_dir(tiny_model_dir, golden_dir, tmp_path_factory) -> Path:
    return build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("cv2_voice_api"))


def cv2_config(model_dir: Path, voices_dir: Path, **sections):
    data = {
        "engine": {"backend": "cosyvoice2", "model_dir": str(model_dir), "voices_dir": str(voices_dir)},
        "webrtc": {"loopback_only": True, "connect_timeout_s": 20.0},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return config_from_dict(data)


@contextlib.asynccontextmanager
async def serve(config):
    client = TestClient(TestServer(create_app(config)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


def form(audio: bytes | None, transcript: str | None = None, **fields: str) -> aiohttp.FormData:
    data = aiohttp.FormData()
    if audio is not None:
        data.add_field("audio", audio, filename="clip.bin", content_type="application/octet-stream")
    if transcript is not None:
        data.add_field("transcript", transcript)
    for key, value in fields.items():
        data.add_field(key, value)
    return data


async def expect_error(resp, status: int, code: str) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert body["error"]["code"] == code and body["error"]["message"]
    return body


async def test_register_each_format_list_get_speak_delete(speaking_dir, tmp_path):
    voices_dir = tmp_path / "voices"
    async with serve(cv2_config(speaking_dir, voices_dir)) as client:
        resp = await client.post("/v1/voices", data=form(clip("wav"), "Hello world.", id="ann", name="Ann"))
        assert resp.status == 201, await resp.text()
        ann = await resp.json()
        assert resp.headers["Location"] == "/v1/voices/ann"
        assert ann["id"] == "ann" and ann["name"] == "Ann" and ann["kind"] == "zero_shot"
        assert ann["transcript"] == "Hello world." and ann["prompt_s"] == pytest.approx(2.0)
        assert (voices_dir / "ann.json").is_file() and (voices_dir / "ann.safetensors").is_file()

        payload = {"audio": base64.b64encode(clip("flac")).decode(), "transcript": "Bonjour.", "id": "bea"}
        resp = await client.post("/v1/voices", json=payload)
        assert resp.status == 201, await resp.text()
        for fmt in ("opus", "mp3"):
            resp = await client.post("/v1/voices", data=form(clip(fmt), "Hi there.", id=f"v-{fmt}"))
            assert resp.status == 201, await resp.text()
        resp = await client.post("/v1/voices", data=form(clip("wav"), name="No Words"))  # no transcript
        assert resp.status == 201, await resp.text()
        cross = await resp.json()
        assert cross["kind"] == "cross_lingual" and cross["id"] == "no-words"

        listed = (await (await client.get("/v1/voices")).json())["voices"]
        ids = [v["id"] for v in listed]
        assert ids == [SFT_VOICE, "ann", "bea", "v-opus", "v-mp3", "no-words"]
        assert next(v for v in listed if v["id"] == SFT_VOICE)["deletable"] is False
        assert (await (await client.get("/v1/voices/bea")).json())["transcript"] == "Bonjour."

        peer = PeerClient()  # usable at once: on call create and on speak
        try:
            offer = await peer.offer()
            resp = await client.post("/v1/calls", json={"sdp": offer, "type": "offer", "voice": "ann"})
            assert resp.status == 201, await resp.text()
            call = await resp.json()
            await peer.accept(call["sdp"])
            await peer.wait_open()
            resp = await client.post(f"/v1/calls/{call['id']}/speak", json={"text": "Hi.", "voice": "bea"})
            assert resp.status == 202, await resp.text()
            uid = (await resp.json())["utterance_id"]
            done = await peer.wait_event("speech.done", timeout_s=60, utterance_id=uid)
            assert done["played_ms"] > 0
            speak = f"/v1/calls/{call['id']}/speak"
            resp = await client.post(speak, json={"text": "Yes [laughter].", "instruct": "Speak happily."})
            assert resp.status == 202, await resp.text()
            uid = (await resp.json())["utterance_id"]
            assert (await peer.wait_event("speech.done", timeout_s=60, utterance_id=uid))["played_ms"] > 0
            resp = await client.post(speak, json={"text": "Hello there, again.", "speed": 1.5})
            assert resp.status == 202, await resp.text()  # non-streaming: the segment comes whole
            uid = (await resp.json())["utterance_id"]
            assert (await peer.wait_event("speech.done", timeout_s=60, utterance_id=uid))["played_ms"] > 0
        finally:
            await peer.close()

        resp = await client.delete("/v1/voices/ann")
        assert resp.status == 200 and (await resp.json()) == {"id": "ann", "deleted": True}
        assert not (voices_dir / "ann.json").exists()
        await expect_error(await client.get("/v1/voices/ann"), 404, "unknown_voice")
        await expect_error(await client.delete("/v1/voices/ann"), 404, "unknown_voice")
        await expect_error(await client.delete(f"/v1/voices/{SFT_VOICE}"), 409, "voice_read_only")

    async with serve(cv2_config(speaking_dir, voices_dir)) as client:  # persisted across restarts
        ids = [v["id"] for v in (await (await client.get("/v1/voices")).json())["voices"]]
        assert ids == [SFT_VOICE, "bea", "no-words", "v-mp3", "v-opus"]


async def test_bad_clips_and_requests_get_4xx_with_a_code(speaking_dir, tmp_path):
    config = cv2_config(
        speaking_dir, tmp_path / "voices", limits={"voice_max_bytes": 100_000, "voice_max_s": 3.0}
    )
    async with serve(config) as client:
        cases = [
            (form(clip("wav", seconds=0.5), "Hi."), 400, "audio_too_short"),
            (form(clip("flac", seconds=3.5), "Hi."), 400, "audio_too_long"),
            (form(clip("wav", amplitude=0.0), "Hi."), 400, "audio_silent"),
            (form(b"RIFF\x00\x00 definitely not audio", "Hi."), 400, "audio_undecodable"),
            (form(clip("wav", seconds=3.0) + b"\x00" * 10_000, "Hi."), 413, "audio_too_large"),
            (form(None, "Hi."), 400, "audio_missing"),
            (form(clip("wav"), "Hi.", id="../etc"), 400, "bad_input"),
        ]
        for data, status, code in cases:
            await expect_error(await client.post("/v1/voices", data=data), status, code)
        await expect_error(
            await client.post("/v1/voices", json={"audio": "%%% not base64", "transcript": "x"}),
            400,
            "bad_base64",
        )
        too_big = base64.b64encode(b"\x00" * 150_000).decode()
        await expect_error(await client.post("/v1/voices", json={"audio": too_big}), 413, "audio_too_large")
        wav_body = await client.post("/v1/voices", data=b"x", headers={"Content-Type": "audio/wav"})
        await expect_error(wav_body, 415, "unsupported_media_type")
        assert (await client.post("/v1/voices", data=form(clip("wav"), "Hi.", id="dup"))).status == 201
        await expect_error(
            await client.post("/v1/voices", data=form(clip("wav"), "Hi.", id="dup")), 409, "voice_exists"
        )
        ids = [v["id"] for v in (await (await client.get("/v1/voices")).json())["voices"]]
        assert ids == [SFT_VOICE, "dup"]


async def test_piper_lists_its_voice_and_refuses_registration():
    config = config_from_dict({"engine": {"backend": "piper"}})
    async with serve(config) as client:
        voices = (await (await client.get("/v1/voices")).json())["voices"]
        assert len(voices) == 1 and voices[0]["kind"] == "builtin" and voices[0]["deletable"] is False
        assert (await client.get(f"/v1/voices/{voices[0]['id']}")).status == 200
        body = await expect_error(
            await client.post("/v1/voices", data=form(clip("wav"), "Hi.")), 400, "not_supported"
        )
        assert "not supported by this engine" in body["error"]["message"]
        await expect_error(await client.delete(f"/v1/voices/{voices[0]['id']}"), 400, "not_supported")


async def test_voice_routes_need_the_bearer_token():
    config = config_from_dict({"engine": {"backend": "fake"}, "auth": {"tokens": ["s3cret"]}})
    async with serve(config) as client:
        await expect_error(await client.get("/v1/voices"), 401, "unauthorized")
        await expect_error(
            await client.post("/v1/voices", data=form(clip("wav"), "Hi.")), 401, "unauthorized"
        )
        resp = await client.get("/v1/voices", headers={"Authorization": "Bearer s3cret"})
        assert resp.status == 200 and [v["id"] for v in (await resp.json())["voices"]] == ["tone", "silence"]


async def test_openapi_documents_the_voice_api_and_readyz():
    async with serve(config_from_dict({"engine": {"backend": "fake"}})) as client:
        spec = await (await client.get("/openapi.json")).json()
        assert {"get", "post"} <= set(spec["paths"]["/v1/voices"])
        assert {"get", "delete"} <= set(spec["paths"]["/v1/voices/{voice_id}"])
        post = spec["paths"]["/v1/voices"]["post"]
        assert {"multipart/form-data", "application/json"} <= set(post["requestBody"]["content"])
        assert {"201", "400", "409", "413", "415"} <= set(post["responses"])
        assert "audio_too_short" in post["responses"]["400"]["description"]
        assert "/readyz" in spec["paths"] and "Voice" in spec["components"]["schemas"]


async def test_fake_voice_book_registers_speaks_and_deletes_like_cosyvoice2():
    """`[fake] voice_book`: the whole voice API on the fake engine, with CosyVoice2's checks and codes."""
    config = config_from_dict({"engine": {"backend": "fake"}, "fake": {"voice_book": True, "ttfa_ms": 0}})
    async with serve(config) as client:
        resp = await client.post(
            "/v1/voices", data=form(clip("wav", seconds=2.0), " Hello world. ", id="ann")
        )
        assert resp.status == 201, await resp.text()
        ann = await resp.json()
        assert resp.headers["Location"] == "/v1/voices/ann"
        assert (ann["kind"], ann["transcript"], ann["source"], ann["deletable"]) == (
            "zero_shot", "Hello world.", "memory", True,
        )  # fmt: skip
        assert ann["prompt_s"] == pytest.approx(2.0, abs=0.05) and ann["created_at"] > 0
        body = {"audio": base64.b64encode(clip("flac")).decode(), "name": "Quiet One"}
        quiet = await (await client.post("/v1/voices", json=body)).json()
        assert (quiet["id"], quiet["name"], quiet["kind"]) == ("quiet-one", "Quiet One", "cross_lingual")
        listed = await (await client.get("/v1/voices")).json()
        assert [v["id"] for v in listed["voices"]] == ["tone", "silence", "ann", "quiet-one"]

        speech = await client.post("/v1/audio/speech", json={"input": "Hi there.", "voice": "ann"})
        assert speech.status == 200 and len(await speech.read()) > 0

        await expect_error(
            await client.post("/v1/voices", data=form(clip("wav"), id="ann")), 409, "voice_exists"
        )
        await expect_error(
            await client.post("/v1/voices", data=form(clip("wav"), id="tone")), 409, "voice_exists"
        )
        await expect_error(
            await client.post("/v1/voices", data=form(clip("wav"), id="con")), 400, "bad_input"
        )
        wordy = await client.post("/v1/voices", data=form(clip("wav", seconds=1.5), "word " * 30))
        assert "per second" in (await expect_error(wordy, 400, "bad_input"))["error"]["message"]
        await expect_error(await client.post("/v1/voices", data=form(b"nope")), 400, "audio_undecodable")

        await expect_error(await client.delete("/v1/voices/tone"), 409, "voice_read_only")
        assert (await client.delete("/v1/voices/ann")).status == 200
        await expect_error(await client.delete("/v1/voices/ann"), 404, "unknown_voice")
        gone = await client.post("/v1/audio/speech", json={"input": "Hi there.", "voice": "ann"})
        assert gone.status in (400, 404) and (await gone.json())["error"]["code"] == "unknown_voice"
