"""The remote engine on a real local Ray cluster: calls speak through Serve replicas.

One cluster for the module (loopback only: node, GCS and agents on 127.0.0.1, no dashboard, no HTTP
proxy, token auth with a token file of the test's own; `ray_cluster.local_cluster`). Two apps: `fake`
(two replicas of the fake engine) and `cv2` (one replica of the tiny CosyVoice2 directory). Front-ends
are `RemoteEngine`s in this process (each with its own Ray driver process), the transport is the real
`Call` with an aiortc peer, or a `RingSink` read at playout pace. Two front-ends at once, and voices
registered through one: `test_ray_frontends.py`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("ray") is None:
    pytest.skip("needs the scale extra (ray[serve])", allow_module_level=True)

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402
from call_helpers import PeerClient, fake_config, rms  # noqa: E402
from ray_cluster import (  # noqa: E402
    CV2_APP,
    FAKE_APP,
    LONG_TEXT,
    Listener,
    front_end,
    local_cluster,
    played_ring,
    remote,
)
from ray_helpers import assert_loopback_only  # noqa: E402

from signaling.app import ENGINE, create_app  # noqa: E402
from voicertc import __version__  # noqa: E402
from voicertc.assemble import create_local_engine  # noqa: E402
from voicertc.engine.protocol import Cancelled, Done, Failed, FirstAudio  # noqa: E402
from voicertc.errors import EngineUnavailableError  # noqa: E402
from voicertc.remote.client import RemoteEngine, VersionSkewError  # noqa: E402
from voicertc.remote.deployment import build_app  # noqa: E402
from voicertc.webrtc import patch_aioice_loopback  # noqa: E402
from voicertc.webrtc.call import Call  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir) -> Iterator[Path]:
    with local_cluster(tmp_path_factory, tiny_model_dir, cv2_replicas=1) as speaking_dir:
        yield speaking_dir


@pytest.fixture(scope="module")
def engine(cluster) -> Iterator[RemoteEngine]:
    with remote() as eng:
        yield eng


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


def kill_replica(app: str, replica: str) -> None:
    import ray

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(f"SERVE_REPLICA::{app}#") and actor["name"].endswith(f"#{replica}"):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            return
    raise AssertionError(f"no replica {replica} of {app}")


def test_every_ray_socket_listens_on_loopback_only(engine):
    """GCS, raylet, agents, workers and the replicas' gRPC servers: 127.0.0.1, never every interface."""
    assert_loopback_only(os.getpid())


# --- speaking through a replica -----------------------------------------------------------------------


async def test_an_aiortc_call_speaks_through_a_remote_replica(engine):
    config = front_end(FAKE_APP)
    call = Call("remote-1", engine, config)
    client = PeerClient()
    try:
        await client.accept(await call.answer(await client.offer()))
        await client.wait_open()
        handle = call.speak("Hello from a remote replica.")
        done = await asyncio.wait_for(handle.done(), 20)
        assert done["type"] == "speech.done", done
        assert done["played_ms"] == pytest.approx(28 * 65, rel=0.1)
        started = await client.wait_event("speech.started", utterance_id=handle.utterance_id)
        assert started["ttfa_ms"] > 0
        await asyncio.sleep(0.3)  # frames in flight
        assert rms(client.audio()) > 0.05
        assert engine.replicas[handle.utterance_id]
        assert not engine.supports("instruct")
    finally:
        await client.close()
        await call.close("test over")


async def test_the_tiny_cosyvoice2_replica_speaks(cluster):
    with remote(CV2_APP) as eng:
        async with played_ring() as (ring, sink):
            listener = Listener()
            eng.say(None, sink, listener, "Hello.")
            event = await listener.terminal(60.0)
            assert isinstance(event, Done), listener.events
            assert eng.supports("instruct")  # the replicas' backend features reach the front-end
            assert event.audio_ms > 0
            assert any(isinstance(e, FirstAudio) for e in listener.events)


async def test_interrupt_stops_the_replica_generator_within_one_chunk(engine):
    config = front_end(FAKE_APP, engine={"max_ahead_ms": 20000, "max_queued_ms": 20000})
    with remote(**{"engine": {"max_ahead_ms": 20000, "max_queued_ms": 20000}}) as eng:
        call = Call("remote-2", eng, config)
        client = PeerClient()
        try:
            await client.accept(await call.answer(await client.offer()))
            await client.wait_open()
            handle = call.speak(LONG_TEXT)
            await client.wait_event("speech.started", timeout_s=20, utterance_id=handle.utterance_id)
            uid, _played = call.interrupt()
            assert uid == handle.utterance_id
            interrupted = await handle.done()
            assert interrupted["type"] == "speech.interrupted"
            assert interrupted["heard_text"], interrupted  # the replica's text marks reached the sink
        finally:
            await client.close()
            await call.close("test over")
        report = await _report(eng, handle.utterance_id)
        assert report["cancelled"] is True
        assert report["pieces_after_close"] <= 1, report
        full_ms = len(LONG_TEXT) * 65
        assert report["sent_ms"] < full_ms / 2, report  # it stopped, long before the end


async def _report(eng: RemoteEngine, utterance_id: str) -> dict[str, Any]:
    for _ in range(50):  # the replica records it when its generator has unwound
        report = await asyncio.to_thread(eng.report, utterance_id)
        if report is not None:
            return report
        await asyncio.sleep(0.1)
    raise AssertionError(f"no report for {utterance_id}")


async def test_four_calls_keep_their_replica_for_three_utterances(engine):
    async def one_call() -> list[str]:
        async with played_ring() as (_ring, sink):
            uids = []
            for n in range(3):
                listener = Listener()
                uids.append(engine.say(None, sink, listener, f"Utterance number {n}."))
                assert isinstance(await listener.terminal(), Done), listener.events
            return [engine.replicas[uid] for uid in uids]

    per_call = await asyncio.gather(*(one_call() for _ in range(4)))
    assert all(len(set(replicas)) == 1 for replicas in per_call), per_call
    assert len({replicas[0] for replicas in per_call}) == 2, per_call  # both replicas serve calls


async def test_front_end_memory_stays_bounded_when_nobody_reads(engine):
    async with played_ring(read=False) as (ring, sink):
        listener = Listener()
        uid = engine.say(None, sink, listener, LONG_TEXT)
        await listener.first_audio()
        for _ in range(100):  # until the replica reached its credit (1000 ms ahead of no playout)
            if ring.queued_ms >= 900:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # unbounded, the replica would add 4 s of audio meanwhile
        assert 900 <= ring.queued_ms <= 1100, ring.queued_ms
        assert not listener.events[1:], listener.events  # still open, only waiting for credit
        engine.cancel(uid)
        assert isinstance(await listener.terminal(), Cancelled)
    report = await _report(engine, uid)
    assert report["sent_ms"] <= 1100, report


async def test_audio_beyond_the_ring_waits_for_room_then_completes(cluster):
    """The replica may finish while the front-end still holds audio the ring has no room for."""
    with remote(engine={"max_ahead_ms": 4000}) as eng:
        async with played_ring(high_water_ms=500) as (_ring, sink):
            listener = Listener()
            eng.say(None, sink, listener, "A sentence of about two seconds.")
            event = await listener.terminal()
            assert isinstance(event, Done), listener.events
            assert event.audio_ms == pytest.approx(32 * 65, rel=0.1)


# --- faults -------------------------------------------------------------------------------------------


def test_version_skew_is_refused_at_connect_naming_both_versions(cluster):
    eng = RemoteEngine(front_end(FAKE_APP), client_version="0.0.0-old")
    with pytest.raises(VersionSkewError) as err:
        eng.start()
    assert "voicertc 0.0.0-old" in str(err.value) and f"voicertc {__version__}" in str(err.value)
    assert not eng.running


def test_an_engine_app_that_is_not_there_is_refused_at_start(cluster):
    eng = RemoteEngine(front_end("no-such-app", ray={"connect_timeout_s": 5.0}))
    with pytest.raises(EngineUnavailableError, match="no-such-app"):
        eng.start()


def test_a_wrong_token_is_reported_as_rejected_not_unreachable(cluster, tmp_path):
    """A front-end whose token file is not the cluster's: refused at once, saying "token rejected"."""
    import ray

    wrong = tmp_path / "wrong_token"
    wrong.write_text(secrets.token_hex(32))
    address = ray.get_runtime_context().gcs_address
    script = (
        "from voicertc.config import RayConfig\n"
        "from voicertc.remote.connect import connect_ray\n"
        "from voicertc.errors import EngineUnavailableError\n"
        "try:\n"
        f"    connect_ray(RayConfig(address={address!r}, auth_token_path={str(wrong)!r}))\n"
        "except EngineUnavailableError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert "REFUSED" in out.stdout, (out.stdout, out.stderr[-2000:])
    assert "token rejected" in out.stdout and "unreachable" not in out.stdout, out.stdout
    assert "cannot reach" not in out.stdout, out.stdout


async def test_a_stalled_replica_is_avoided_alone_and_taken_back_when_it_answers(cluster):
    """SIGSTOP one of two replicas: its utterance fails at the deadline, the engine stays available,
    the immediate retry goes to the other one; after SIGCONT it takes new calls again."""
    with remote(ray={"stall_timeout_s": 2.0, "control_timeout_s": 1.0}) as eng:
        async with played_ring() as (_ring, sink):
            warm = Listener()
            eng.say(None, sink, warm, "Warm up.")
            assert isinstance(await warm.terminal(), Done)
            victim = eng.replicas[warm.events[-1].utterance_id]
            pid = eng.replica_pids[victim]
            availability: list[bool] = []

            async def watch() -> None:
                while True:
                    availability.append(eng.available)
                    await asyncio.sleep(0.05)

            listener = Listener()
            eng.say(None, sink, listener, LONG_TEXT)
            await listener.first_audio()
            watcher = asyncio.get_running_loop().create_task(watch())
            os.kill(pid, signal.SIGSTOP)  # alive, silent: a stalled replica
            try:
                event = await listener.terminal()
                assert isinstance(event, Failed) and event.code == "engine_lost", listener.events
                assert "stall_timeout_s" in event.message
                assert_short_and_clean(event.message, pid)

                after = Listener()  # the call's immediate retry, while the victim is still stopped
                next_uid = eng.say(None, sink, after, "Still here.")
                assert isinstance(await after.terminal(), Done), after.events
                assert eng.replicas[next_uid] != victim
                await asyncio.sleep(1.5)  # health probes run meanwhile (one of them times out)
                assert eng.avoided(victim)
            finally:
                os.kill(pid, signal.SIGCONT)
                watcher.cancel()
            assert availability and all(availability), "the whole engine was marked unavailable"

        for _ in range(100):  # a probe of it succeeds: it is taken back
            if not eng.avoided(victim):
                break
            await asyncio.sleep(0.1)
        assert not eng.avoided(victim)
        async with played_ring() as (_ring, new_sink):  # a new call goes to the least loaded: the victim
            fresh = Listener()
            uid = eng.say(None, new_sink, fresh, "A new call.")
            assert isinstance(await fresh.terminal(), Done), fresh.events
            assert eng.replicas[uid] == victim


def assert_short_and_clean(message: str, pid: int) -> None:
    """A caller-facing error: one line of at most 200 characters, none of Ray's internals."""
    assert len(message) <= 200 and "\n" not in message, message
    assert str(pid) not in message and "pid" not in message.lower(), message
    assert "127.0.0.1" not in message and "actor" not in message.lower(), message


async def test_a_killed_replica_fails_its_utterance_and_the_next_one_moves(cluster, caplog):
    caplog.set_level(logging.INFO, logger="voicertc.remote.client")
    with remote() as eng:
        async with played_ring() as (_ring, sink):
            warm = Listener()
            eng.say(None, sink, warm, "Warm up.")
            assert isinstance(await warm.terminal(), Done)
            victim = eng.replicas[warm.events[-1].utterance_id]

            listener = Listener()
            uid = eng.say(None, sink, listener, LONG_TEXT)
            await listener.first_audio()
            assert eng.replicas[uid] == victim
            await asyncio.to_thread(kill_replica, FAKE_APP, victim)
            event = await listener.terminal()
            assert isinstance(event, Failed) and event.code == "engine_lost", listener.events
            assert_short_and_clean(event.message, eng.replica_pids[victim])
            # Ray's account goes to the log, with the utterance and the replica's id (never None)
            lost = [r.getMessage() for r in caplog.records if "lost its engine replica" in r.getMessage()]
            assert any(
                f"utterance {uid} " in m and f"lost its engine replica {victim}:" in m for m in lost
            ), lost
            assert any(f"utterance {uid}: Ray's account" in r.getMessage() for r in caplog.records)

            after = Listener()
            next_uid = eng.say(None, sink, after, "Still here.")
            assert isinstance(await after.terminal(), Done), after.events
            assert eng.replicas[next_uid] != victim


@pytest.mark.gpu
async def test_two_cosyvoice2_replicas_share_one_gpu(cluster):
    """Fractional GPUs: two replicas of num_gpus = 0.5 on one device, both speak (GPU only)."""
    from ray import serve

    config = fake_config(
        engine={"backend": "cosyvoice2", "model_dir": str(cluster), "voices_dir": "", "device": "cuda"},
        ray={"num_replicas": 2, "num_gpus": 0.5, "num_cpus": 0.5},
    )
    app = build_app(config, create_local_engine)
    await asyncio.to_thread(serve.run, app, name="voicertc-cv2-gpu", route_prefix=None)
    try:
        with remote("voicertc-cv2-gpu") as eng:
            async with played_ring() as (_r1, sink1), played_ring() as (_r2, sink2):
                listeners = [Listener(), Listener()]
                uids = [
                    eng.say(None, sink, lis, "Hello.")
                    for sink, lis in zip((sink1, sink2), listeners, strict=True)
                ]
                for lis in listeners:
                    assert isinstance(await lis.terminal(60.0), Done), lis.events
            assert len({eng.replicas[uid] for uid in uids}) == 2
    finally:
        await asyncio.to_thread(serve.delete, "voicertc-cv2-gpu")


def test_an_engine_without_a_voice_book_refuses_registration_as_in_process(engine):
    """The fake replicas register nothing: 400 `not_supported`, as the in-process fake answers."""
    from audio_clips import clip

    from voicertc.audio.decode import decode_audio
    from voicertc.errors import NotSupportedError

    future = engine.register_voice(decode_audio(clip(seconds=2.0)), "Hello.", None, "")
    with pytest.raises(NotSupportedError) as err:
        future.result(30)
    assert err.value.code == "not_supported"


async def test_http_front_end_location_and_503_while_the_engine_is_gone(cluster):
    """Runs last: it deletes the fake app. The call stays up; speak answers 503 + Retry-After."""
    from ray import serve

    config = front_end(
        FAKE_APP, server={"public_url": "http://front-1.example:8080/"}, ray={"retry_after_s": 7}
    )
    client = TestClient(TestServer(create_app(config)))
    await client.start_server()
    peer = PeerClient()
    try:
        resp = await client.post(
            "/v1/calls", data=await peer.offer(), headers={"Content-Type": "application/sdp"}
        )
        assert resp.status == 201, await resp.text()
        location = resp.headers["Location"]
        assert location.startswith("http://front-1.example:8080/v1/calls/"), location
        call_id = location.rsplit("/", 1)[1]
        await peer.accept(await resp.text())
        await peer.wait_open()
        resp = await client.post(f"/v1/calls/{call_id}/speak", json={"text": "Before the outage."})
        assert resp.status == 202, await resp.text()

        engine = client.app[ENGINE]
        await asyncio.to_thread(serve.delete, FAKE_APP)
        for _ in range(100):  # the health probe notices (every ray.health_interval_s)
            if not engine.available:
                break
            await asyncio.sleep(0.1)
        resp = await client.post(f"/v1/calls/{call_id}/speak", json={"text": "During the outage."})
        assert resp.status == 503, await resp.text()
        assert (await resp.json())["error"]["code"] == "engine_unavailable"
        assert resp.headers["Retry-After"] == "7"  # [ray] retry_after_s
        assert (await client.get(f"/v1/calls/{call_id}")).status == 200  # the call is still up
        resp = await client.get("/v1/voices")  # the page asks on every load: 503, not 500
        assert resp.status == 503, await resp.text()
        assert (await resp.json())["error"]["code"] == "engine_unavailable"
        assert resp.headers["Retry-After"] == "7"  # [ray] retry_after_s
        ready = await client.get("/readyz")
        assert ready.status == 503
        reason = (await ready.json())["reason"]  # names the app and what to run, not Ray's internals
        assert FAKE_APP in reason and "voicertc engine-serve" in reason, reason
        assert "Deployment(name=" not in reason, reason
    finally:
        await peer.close()
        await client.close()
