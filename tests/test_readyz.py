"""GET /readyz: 503 + reason until the engine has loaded and warmed up, 200 while it serves, 503 after."""

from __future__ import annotations

import asyncio
import threading

from aiohttp.test_utils import TestClient, TestServer
from call_helpers import fake_config

from signaling.app import create_app
from voicertc.engine.fake import FakeBackend
from voicertc.engine.worker import EngineWorker


async def _ready_body(client: TestClient) -> tuple[int, dict]:
    resp = await client.get("/readyz")
    return resp.status, await resp.json()


async def test_ready_once_started_and_not_after_stop():
    config = fake_config()
    engine = EngineWorker(backend_factory=lambda: FakeBackend(config.fake))
    client = TestClient(TestServer(create_app(config, engine)))
    await client.start_server()
    try:
        assert await _ready_body(client) == (200, {"status": "ready", "engine": "fake"})
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        status, body = await _ready_body(client)
        assert status == 503 and body["status"] == "not_ready" and "stopped" in body["reason"]
        assert (await client.get("/healthz")).status in (200, 503)  # liveness is a separate route
    finally:
        await client.close()


async def test_background_load_answers_503_loading_then_200():
    config = fake_config(engine={"load_in_background": True})
    release = threading.Event()

    def slow_backend() -> FakeBackend:
        release.wait(30)
        return FakeBackend(config.fake)

    engine = EngineWorker(backend_factory=slow_backend)
    client = TestClient(TestServer(create_app(config, engine)))
    await client.start_server()  # listens while the engine still loads
    try:
        status, body = await _ready_body(client)
        assert status == 503 and "loading" in body["reason"]
        resp = await client.post("/v1/calls", json={"type": "offer", "sdp": "v=0"})
        assert resp.status in (400, 503)  # nothing is accepted before the engine is ready
        release.set()
        for _ in range(200):
            status, body = await _ready_body(client)
            if status == 200:
                break
            await asyncio.sleep(0.05)
        assert status == 200, body
    finally:
        release.set()
        await client.close()
        engine.stop()


async def test_a_failed_background_load_is_the_reason():
    config = fake_config(engine={"load_in_background": True})

    def broken() -> FakeBackend:
        raise RuntimeError("campplus.onnx: cannot load ONNX model")

    client = TestClient(TestServer(create_app(config, EngineWorker(backend_factory=broken))))
    await client.start_server()
    try:
        for _ in range(200):
            status, body = await _ready_body(client)
            if "failed" in body["reason"]:
                break
            await asyncio.sleep(0.05)
        assert status == 503
        assert "failed to load" in body["reason"] and "campplus.onnx" in body["reason"]
    finally:
        await client.close()
