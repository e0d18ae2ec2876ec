"""Several front-ends on one engine app, each with its own Ray driver process (a real local cluster).

`ray_cluster.local_cluster`: two fake replicas and two tiny-CosyVoice2 replicas sharing one
`[engine] voices_dir`, loopback only, token auth. Proves: calls of two front-ends spread evenly over
two replicas (each front-end's router counts its own open utterances and what the replicas report of
the other's); a voice registered through front-end A is on both replicas and is listed, described,
spoken and deleted through front-end B with the in-process codes; a front-end whose driver process is
killed answers 503 meanwhile and starts a new driver by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("ray") is None:
    pytest.skip("needs the scale extra (ray[serve])", allow_module_level=True)

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402
from ray_cluster import (  # noqa: E402
    CV2_APP,
    LONG_TEXT,
    Listener,
    front_end,
    local_cluster,
    played_ring,
    remote,
    voices_dir_of,
)

from signaling.app import ENGINE, create_app  # noqa: E402
from voicertc.engine.protocol import Cancelled, Done, Failed  # noqa: E402
from voicertc.errors import EngineUnavailableError  # noqa: E402
from voicertc.remote.client import RemoteEngine  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir) -> Iterator[Path]:
    with local_cluster(tmp_path_factory, tiny_model_dir, cv2_replicas=2) as speaking_dir:
        yield speaking_dir


async def test_two_front_ends_spread_sixteen_calls_evenly_over_two_replicas(cluster):
    """Front-ends A and B (two driver processes, two routers) open 8 calls each, in turn: each places
    a new call by its own open utterances plus what the replicas report of the other's, so the 16
    calls end within +-1 of 8 per replica. Nobody reads: every utterance stays open (at its credit)."""
    probes = {"health_interval_s": 0.2}
    with remote(ray=probes) as a, remote(ray=probes) as b:
        assert a.driver_pid != b.driver_pid
        placed: list[str] = []
        opened: list[tuple[RemoteEngine, str, Listener]] = []
        async with contextlib.AsyncExitStack() as stack:
            for n in range(16):
                eng, other = (a, b) if n % 2 == 0 else (b, a)
                _ring, sink = await stack.enter_async_context(played_ring(read=False))
                listener = Listener()
                uid = eng.say(None, sink, listener, LONG_TEXT)
                await listener.first_audio()
                placed.append(eng.replicas[uid])
                opened.append((eng, uid, listener))
                seen = other.health_reports
                for _ in range(200):  # until the other's driver has asked the replicas since
                    if other.health_reports >= seen + 2:
                        break
                    await asyncio.sleep(0.02)
            counts = Counter(placed)
            assert len(counts) == 2 and all(abs(c - 8) <= 1 for c in counts.values()), placed
            for eng, uid, listener in opened:
                eng.cancel(uid)
                assert isinstance(await listener.terminal(), Cancelled), listener.events


async def test_voices_registered_through_one_front_end_are_listed_and_spoken_through_another(cluster):
    """Front-ends A and B (each its own Ray driver process) on the two-replica cv2 app: a voice
    registered through A is computed once, stored in the app's voices_dir and loaded by both replicas;
    B lists, describes and speaks it; B deletes it everywhere; the codes are the in-process ones."""
    import base64

    from audio_clips import clip

    voices_dir = voices_dir_of(cluster)
    a = TestClient(TestServer(create_app(front_end(CV2_APP))))
    b = TestClient(TestServer(create_app(front_end(CV2_APP))))
    await a.start_server()
    await b.start_server()
    try:
        assert a.app[ENGINE].driver_pid != b.app[ENGINE].driver_pid
        body = {
            "audio": base64.b64encode(clip(seconds=3.0)).decode(),
            "transcript": "Hello there.",
            "id": "ann",
        }
        resp = await a.post("/v1/voices", json=body)
        assert resp.status == 201, await resp.text()
        ann = await resp.json()
        assert ann["id"] == "ann" and ann["kind"] == "zero_shot", ann
        assert (voices_dir / "ann.json").is_file() and (voices_dir / "ann.safetensors").is_file()
        infos = await asyncio.to_thread(b.app[ENGINE].replica_infos)
        assert len(infos) == 2 and all("ann" in info["voices"] for info in infos.values()), infos

        resp = await b.get("/v1/voices")
        assert resp.status == 200, await resp.text()
        listed = [v["id"] for v in (await resp.json())["voices"]]
        assert "ann" in listed and listed == b.app[ENGINE].voices(), listed
        assert (await b.get("/v1/voices/no-such-voice")).status == 404
        resp = await b.get("/v1/voices/ann")
        assert resp.status == 200 and (await resp.json()) == ann
        speech = {"input": "Hello.", "voice": "ann", "response_format": "wav"}
        resp = await b.post("/v1/audio/speech", json=speech)
        assert resp.status == 200, await resp.text()
        wav = await resp.read()
        assert wav[:4] == b"RIFF" and len(wav) > 1000, len(wav)

        resp = await b.post("/v1/voices", json=body)  # the same id again: the in-process code
        assert resp.status == 409 and (await resp.json())["error"]["code"] == "voice_exists"
        resp = await b.delete("/v1/voices/ann")
        assert resp.status == 200, await resp.text()
        assert not (voices_dir / "ann.json").exists()
        infos = await asyncio.to_thread(a.app[ENGINE].replica_infos)
        assert all("ann" not in info["voices"] for info in infos.values()), infos
        resp = await a.get("/v1/voices/ann")
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "unknown_voice"
        resp = await a.delete("/v1/voices/ann")
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "unknown_voice"
        sft = next(v for v in (await (await a.get("/v1/voices")).json())["voices"] if not v["deletable"])
        resp = await a.delete(f"/v1/voices/{sft['id']}")
        assert resp.status == 409 and (await resp.json())["error"]["code"] == "voice_read_only"
    finally:
        await a.close()
        await b.close()


async def test_a_killed_driver_process_is_replaced_by_the_front_end(cluster):
    """SIGKILL the front-end's Ray driver process (what Ray does to it when the cluster stops): the
    utterance playing ends with engine_lost, opening one raises 503 engine_unavailable while no driver
    runs, and a new driver joins by itself; the next utterance speaks."""
    with remote(ray={"retry_after_s": 1}) as eng:
        async with played_ring() as (_ring, sink):
            listener = Listener()
            eng.say(None, sink, listener, LONG_TEXT)
            await listener.first_audio()
            first = eng.driver_pid
            assert first is not None
            os.kill(first, signal.SIGKILL)
            event = await listener.terminal()
            assert isinstance(event, Failed) and event.code == "engine_lost", listener.events
            with pytest.raises(EngineUnavailableError) as err:  # before the new driver joined
                eng.say(None, sink, Listener(), "Too early.")
            assert "reconnecting" in str(err.value) and err.value.retry_after_s == 1
            for _ in range(300):
                if eng.available:
                    break
                await asyncio.sleep(0.1)
            assert eng.available and eng.driver_pid not in (None, first)
            assert len(eng.reconnects) == 1
            after = Listener()
            eng.say(None, sink, after, "Back again.")
            assert isinstance(await after.terminal(), Done), after.events
