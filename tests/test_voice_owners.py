"""Registered voices have owners like calls (other tokens: 404, admin: all), caps per token and in all,
and ids with dots that keep their own files and come back after a restart (tiny CosyVoice2, real clips)."""

from __future__ import annotations

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

ALICE, BOB, ADMIN = "alice-token", "bob-token", "admin-token"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


@pytest.fixture(scope="module")
def speaking_dir(tiny_model_dir, golden_dir, tmp_path_factory) -> Path:
    return build_speaking_model_dir(tiny_model_dir, golden_dir, tmp_path_factory.mktemp("cv2_voice_owners"))


def config(model_dir: Path, voices_dir: Path, **limits):
    return config_from_dict(
        {
            "engine": {"backend": "cosyvoice2", "model_dir": str(model_dir), "voices_dir": str(voices_dir)},
            "webrtc": {"loopback_only": True, "connect_timeout_s": 20.0},
            "auth": {"tokens": [ALICE, BOB], "admin_tokens": [ADMIN]},
            "limits": {"max_voices": 3, "max_voices_per_token": 2, **limits},
        }
    )


@contextlib.asynccontextmanager
async def serve(cfg):
    client = TestClient(TestServer(create_app(cfg)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def register(client, token: str, voice_id: str, transcript: str, status: int = 201) -> dict:
    data = aiohttp.FormData()
    data.add_field("audio", clip("wav"), filename="clip.wav", content_type="audio/wav")
    data.add_field("transcript", transcript)
    data.add_field("id", voice_id)
    resp = await client.post("/v1/voices", data=data, headers=bearer(token))
    assert resp.status == status, await resp.text()
    return await resp.json()


async def ids_for(client, token: str) -> list[str]:
    resp = await client.get("/v1/voices", headers=bearer(token))
    assert resp.status == 200, await resp.text()
    return [v["id"] for v in (await resp.json())["voices"]]


async def expect(resp, status: int, code: str) -> str:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert body["error"]["code"] == code, body
    return body["error"]["message"]


async def test_owners_caps_dotted_ids_and_a_restart(speaking_dir, tmp_path):
    voices_dir = tmp_path / "voices"
    async with serve(config(speaking_dir, voices_dir)) as client:
        await register(client, ALICE, "a.b", "Alice one.")
        await register(client, ALICE, "a.c", "Alice two.")
        # two dotted ids, two sets of files (a.b and a.c once shared a.json / a.safetensors)
        names = sorted(p.name for p in voices_dir.iterdir() if not p.name.startswith("."))
        assert names == ["a.b.json", "a.b.safetensors", "a.c.json", "a.c.safetensors"]

        # per-token cap, then the total cap (admins are held only by the total)
        msg = await expect(
            await client.post("/v1/voices", data={"transcript": "x"}, headers=bearer(ALICE)),
            429,
            "too_many_voices",
        )
        assert "limits.max_voices_per_token" in msg
        await register(client, BOB, "bob", "Bob here.")
        data = aiohttp.FormData()
        data.add_field("audio", clip("wav"), filename="clip.wav")
        msg = await expect(
            await client.post("/v1/voices", data=data, headers=bearer(ADMIN)), 429, "too_many_voices"
        )
        assert "limits.max_voices" in msg

        # Bob sees the shared voice and his own, nothing of Alice's, and cannot touch hers
        assert await ids_for(client, BOB) == [SFT_VOICE, "bob"]
        assert await ids_for(client, ALICE) == [SFT_VOICE, "a.b", "a.c"]
        assert await ids_for(client, ADMIN) == [SFT_VOICE, "a.b", "a.c", "bob"]
        await expect(await client.get("/v1/voices/a.b", headers=bearer(BOB)), 404, "unknown_voice")
        await expect(await client.delete("/v1/voices/a.b", headers=bearer(BOB)), 404, "unknown_voice")
        assert (await client.get("/v1/voices/a.b", headers=bearer(ADMIN))).status == 200

        peer = PeerClient()  # Bob's call: Alice's voice is unknown to him everywhere he could name it
        try:
            offer = await peer.offer()
            with_voice = {"sdp": offer, "type": "offer", "voice": "a.b"}
            msg = await expect(
                await client.post("/v1/calls", json=with_voice, headers=bearer(BOB)), 400, "unknown_voice"
            )
            assert "a.c" not in msg  # the "available" hint lists only Bob's voices
            resp = await client.post("/v1/calls", json={"sdp": offer, "type": "offer"}, headers=bearer(BOB))
            assert resp.status == 201, await resp.text()
            call = await resp.json()
            await peer.accept(call["sdp"])
            await peer.wait_open()
            speak = f"/v1/calls/{call['id']}/speak"
            msg = await expect(
                await client.post(speak, json={"text": "Hi.", "voice": "a.b"}, headers=bearer(BOB)),
                400,
                "unknown_voice",
            )
            assert "a.c" not in msg
            peer.send({"type": "speak", "text": "Hi.", "voice": "a.c"})
            error = await peer.wait_event("error", timeout_s=10)
            assert error["code"] == "unknown_voice" and "a.b" not in error["message"]
            resp = await client.post(speak, json={"text": "Hi.", "voice": "bob"}, headers=bearer(BOB))
            assert resp.status == 202, await resp.text()
        finally:
            await peer.close()

    async with serve(config(speaking_dir, voices_dir)) as client:  # a restart: ids, data and owners kept
        assert await ids_for(client, ADMIN) == [SFT_VOICE, "a.b", "a.c", "bob"]
        assert await ids_for(client, BOB) == [SFT_VOICE, "bob"]
        one = await (await client.get("/v1/voices/a.b", headers=bearer(ALICE))).json()
        two = await (await client.get("/v1/voices/a.c", headers=bearer(ALICE))).json()
        assert (one["transcript"], two["transcript"]) == ("Alice one.", "Alice two.")
        await expect(await client.get("/v1/voices/a.b", headers=bearer(BOB)), 404, "unknown_voice")

        resp = await client.delete("/v1/voices/a.b", headers=bearer(ALICE))
        assert resp.status == 200 and (await resp.json()) == {"id": "a.b", "deleted": True}
        assert not (voices_dir / "a.b.json").exists() and (voices_dir / "a.c.json").is_file()
        await register(client, ALICE, "a.d", "Alice three.")  # the slot came back
        resp = await client.delete("/v1/voices/bob", headers=bearer(ADMIN))  # an admin deletes anyone's
        assert resp.status == 200
        # an id that differs only in case would share files on a case-insensitive file system
        data = aiohttp.FormData()
        data.add_field("audio", clip("wav"), filename="clip.wav")
        data.add_field("id", "A.C")
        msg = await expect(
            await client.post("/v1/voices", data=data, headers=bearer(ADMIN)), 409, "voice_exists"
        )
        assert "only in case" in msg
