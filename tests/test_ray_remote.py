"""The remote engine on a real local Ray cluster: calls speak through Serve replicas.

One cluster for the module (loopback only: node, GCS and agents on 127.0.0.1, no dashboard, no HTTP
proxy, token auth with a token file of the test's own). Two apps: `fake` (two replicas of the fake
engine) and `cv2` (two replicas of the tiny CosyVoice2 directory, one voices_dir). Front-ends are
`RemoteEngine`s in this process (each with its own Ray driver process), the transport is the real
`Call` with an aiortc peer, or a `RingSink` read at playout pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("ray") is None:
    pytest.skip("needs the scale extra (ray[serve])", allow_module_level=True)

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402
from call_helpers import PeerClient, fake_config, rms  # noqa: E402
from cv2_engine_helpers import make_tiny_model_dir  # noqa: E402
from ray_helpers import assert_loopback_only  # noqa: E402

from signaling.app import ENGINE, create_app  # noqa: E402
from voicertc import __version__  # noqa: E402
from voicertc.assemble import create_local_engine  # noqa: E402
from voicertc.audio import PcmRing, RingSink  # noqa: E402
from voicertc.config import Config, RayConfig  # noqa: E402
from voicertc.engine.protocol import Cancelled, Done, EngineEvent, Failed, FirstAudio  # noqa: E402
from voicertc.errors import EngineUnavailableError  # noqa: E402
from voicertc.remote.client import RemoteEngine, VersionSkewError, apply_auth  # noqa: E402
from voicertc.remote.deployment import build_app  # noqa: E402
from voicertc.remote.loopback import loopback_init_options, not_a_cluster  # noqa: E402
from voicertc.webrtc import patch_aioice_loopback  # noqa: E402
from voicertc.webrtc.call import Call  # noqa: E402

pytestmark = pytest.mark.slow

NOT_A_CLUSTER = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
FAKE_APP = "voicertc-fake"
CV2_APP = "voicertc-cv2"
FAKE = {"ttfa_ms": 20, "rtf": 0.25, "chunk_ms": 100}  # 25 ms of compute per 100 ms piece
LONG_TEXT = "This sentence is long enough to take several seconds to speak out loud. " * 2


def front_end(app: str, **sections: dict[str, Any]) -> Config:
    """A front-end's config: the engine is the Ray app `app`."""
    ray_keys = {"app_name": app, "open_timeout_s": 20.0, "stall_timeout_s": 5.0, "health_interval_s": 0.5}
    engine = {"backend": "ray", "max_ahead_ms": 1000, **sections.pop("engine", {})}
    return fake_config(engine=engine, ray={**ray_keys, **sections.pop("ray", {})}, **sections)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir) -> Iterator[Path]:
    """A local Ray cluster on 127.0.0.1 with the two engine apps, torn down after the module; yields the
    speaking tiny CosyVoice2 directory the cv2 app runs. Ray is imported here, not at collection."""
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", NOT_A_CLUSTER)}
    # Ray swaps 127.0.0.1 for the host's outward address unless told this is no cluster: keep every
    # process of the test cluster (GCS, raylet, workers, agents) on loopback (also `not_a_cluster()`).
    os.environ[NOT_A_CLUSTER] = "0"
    import ray
    from ray import serve

    speaking_dir = make_tiny_model_dir(tmp_path_factory.mktemp("cv2_speak"), checkpoints_from=tiny_model_dir)
    voices_dir = voices_dir_of(speaking_dir)
    token = tmp_path_factory.mktemp("ray") / "auth_token"
    token.write_text(secrets.token_hex(32))
    apply_auth(RayConfig(auth_mode="token", auth_token_path=str(token)))
    from ray._private import ray_constants

    was_cluster = not_a_cluster()  # read at ray.init (the env var above only if set before import)
    ray.init(
        num_cpus=4,
        **loopback_init_options(),
        namespace="voicertc",
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        serve.start(proxy_location="Disabled")
        fake = fake_config(fake=FAKE, ray={"num_replicas": 2, "num_cpus": 0.5})
        cv2 = fake_config(
            engine={"backend": "cosyvoice2", "model_dir": str(speaking_dir), "voices_dir": str(voices_dir)},
            ray={"num_replicas": 2, "num_cpus": 0.5},
        )
        serve.run_many(  # both apps' replicas start at once
            [
                serve.RunTarget(build_app(fake, create_local_engine), name=FAKE_APP, route_prefix=None),
                serve.RunTarget(build_app(cv2, create_local_engine), name=CV2_APP, route_prefix=None),
            ]
        )
        yield speaking_dir
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = was_cluster
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def voices_dir_of(speaking_dir: Path) -> Path:
    """The cv2 app's `[engine] voices_dir` (both replicas share it)."""
    return speaking_dir.with_name(speaking_dir.name + "_voices")


@contextlib.contextmanager
def remote(app: str = FAKE_APP, **sections: dict[str, Any]) -> Iterator[RemoteEngine]:
    engine = RemoteEngine(front_end(app, **sections))
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def engine(cluster) -> Iterator[RemoteEngine]:
    with remote() as eng:
        yield eng


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


class Listener:
    """Collects one utterance's engine events (engine threads) for an asyncio test."""

    def __init__(self) -> None:
        self.events: list[EngineEvent] = []
        self._done = threading.Event()
        self._first = threading.Event()

    def __call__(self, event: EngineEvent) -> None:
        self.events.append(event)
        if isinstance(event, FirstAudio):
            self._first.set()
        if isinstance(event, Done | Failed | Cancelled):
            self._done.set()

    async def first_audio(self, timeout_s: float = 20.0) -> None:
        assert await asyncio.to_thread(self._first.wait, timeout_s), self.events

    async def terminal(self, timeout_s: float = 20.0) -> EngineEvent:
        assert await asyncio.to_thread(self._done.wait, timeout_s), self.events
        return self.events[-1]


@contextlib.asynccontextmanager
async def played_ring(read: bool = True, high_water_ms: float = 4000):
    """A call's ring and sink, read at playout pace (20 ms frames) unless `read` is False."""
    ring = PcmRing(high_water_ms=high_water_ms)
    sink = RingSink(ring)

    async def playout() -> None:
        while True:
            ring.read(960)
            await asyncio.sleep(0.02)

    task = asyncio.get_running_loop().create_task(playout()) if read else None
    try:
        yield ring, sink
    finally:
        if task is not None:
            task.cancel()


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
        assert "ann" in [v["id"] for v in (await resp.json())["voices"]]
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

    config = front_end(FAKE_APP, server={"public_url": "http://front-1.example:8080/"})
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
        assert resp.headers["Retry-After"] == "5"
        assert (await client.get(f"/v1/calls/{call_id}")).status == 200  # the call is still up
        resp = await client.get("/v1/voices")  # the page asks on every load: 503, not 500
        assert resp.status == 503, await resp.text()
        assert (await resp.json())["error"]["code"] == "engine_unavailable"
        assert resp.headers["Retry-After"] == "5"
        ready = await client.get("/readyz")
        assert ready.status == 503
        reason = (await ready.json())["reason"]  # names the app and what to run, not Ray's internals
        assert FAKE_APP in reason and "voicertc engine-serve" in reason, reason
        assert "Deployment(name=" not in reason, reason
    finally:
        await peer.close()
        await client.close()
