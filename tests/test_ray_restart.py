"""The front-end outlives its Ray cluster: stop the cluster under a live call, start it again.

A real `ray start --head --block` cluster of the test's own (127.0.0.1, a fixed GCS port, its own temp
dir and token file), the fake engine app deployed by `voicertc engine-serve --detach` as README writes
it, and an HTTP front-end in this process whose Ray driver runs in a child process. Stopping the
cluster SIGKILLs every process of it (GCS, raylet, workers, replicas): the driver child dies with its
raylet, the front-end process does not.

Proves: the utterance playing at the stop ends with `engine_lost` (not silence); speak answers 503
`engine_unavailable` + Retry-After while the cluster is gone and the call stays up; `/readyz` is 503
and says the Ray driver lost the cluster; once the cluster and the app are back, the front-end has
started a new driver by itself, speak answers 202 on the same call and that utterance plays to the end;
`/readyz` is 200 again. The time from the cluster's restart to the first 202 is logged (bench figure).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("ray") is None:
    pytest.skip("needs the scale extra (ray[serve])", allow_module_level=True)

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402
from call_helpers import PeerClient, fake_config  # noqa: E402

from signaling.app import ENGINE, create_app  # noqa: E402
from voicertc.webrtc import patch_aioice_loopback  # noqa: E402

pytestmark = pytest.mark.slow

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
APP = "voicertc-restart"
LONG_TEXT = "This sentence takes a few seconds to speak, long enough to stop the cluster under it. " * 2


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalCluster:
    """One `ray start --head --block` cluster on 127.0.0.1 that can be stopped and started again."""

    def __init__(self, work: Path, token: Path) -> None:
        self.port = free_port()
        self.work = work
        self.temp_dir = tempfile.mkdtemp(prefix="vr", dir="/tmp")  # short: Ray's socket paths
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # keep every Ray process on 127.0.0.1
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(token),
            PYTHONPATH=str(ROOT),
            PATH=f"{BIN}{os.pathsep}{env['PATH']}",
        )
        self.env = env
        self.head: subprocess.Popen[bytes] | None = None
        self.head_started_s = 0.0
        (work / "config.toml").write_text("[ray]\nnum_cpus = 0.5\n[fake]\nttfa_ms = 20\nrtf = 0.1\n")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the head and deploy the app (`engine-serve --detach` returns once it runs)."""
        self.head_started_s = time.monotonic()
        with (self.work / "ray.log").open("ab") as log:
            self.head = subprocess.Popen(
                [
                    str(BIN / "ray"),
                    "start",
                    "--head",
                    "--block",
                    f"--port={self.port}",
                    "--node-ip-address=127.0.0.1",
                    "--include-dashboard=false",
                    "--disable-usage-stats",
                    "--num-cpus=2",
                    f"--temp-dir={self.temp_dir}",
                ],
                cwd=self.work,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        command = [str(BIN / "voicertc"), "engine-serve", "--address", self.address]
        command += ["--app-name", APP, "--model", "fake", "--detach"]
        deadline = time.monotonic() + 120
        while True:  # the GCS takes a moment to listen: engine-serve says so and exits 1
            out = subprocess.run(
                command, cwd=self.work, env=self.env, capture_output=True, text=True, timeout=180
            )
            if out.returncode == 0:
                return
            assert self.head.poll() is None, (self.work / "ray.log").read_text()[-3000:]
            assert time.monotonic() < deadline, out.stdout[-2000:] + out.stderr[-3000:]
            time.sleep(1.0)

    def stop(self) -> None:
        """SIGKILL every process of this cluster (and only those): a cluster that went away."""
        import psutil

        if self.head is None:
            return
        root = psutil.Process(self.head.pid)
        procs = [root, *root.children(recursive=True)]
        procs += [p for p in psutil.process_iter(["cmdline"]) if self._ours(p) and p not in procs]
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(procs, timeout=30)
        self.head.wait(10)
        self.head = None

    def _ours(self, proc: Any) -> bool:
        """A Ray process of this cluster that is not below the head (workers re-parented to init)."""
        cmdline = " ".join(proc.info.get("cmdline") or ())
        return self.temp_dir in cmdline or f"127.0.0.1:{self.port}" in cmdline and "ray" in cmdline


@pytest.fixture
def cluster(tmp_path) -> Iterator[LocalCluster]:
    token = tmp_path / "ray_token"
    token.write_text(secrets.token_hex(32))
    local = LocalCluster(tmp_path, token)
    local.start()
    try:
        yield local
    finally:
        local.stop()
        shutil.rmtree(local.temp_dir, ignore_errors=True)  # Ray's session files of this cluster


@pytest.fixture(autouse=True)
def loopback_ice():
    restore = patch_aioice_loopback()
    yield
    restore()


async def speak(client: TestClient, call_id: str, text: str) -> Any:
    return await client.post(f"/v1/calls/{call_id}/speak", json={"text": text})


async def test_the_front_end_outlives_a_cluster_restart_under_a_live_call(cluster, tmp_path):
    config = fake_config(
        engine={"backend": "ray", "max_ahead_ms": 1000},
        ray={
            "address": cluster.address,
            "app_name": APP,
            "auth_token_path": str(tmp_path / "ray_token"),
            "connect_timeout_s": 10.0,
            "health_interval_s": 0.5,
            "control_timeout_s": 2.0,
        },
    )
    client = TestClient(TestServer(create_app(config)))
    await client.start_server()
    peer = PeerClient()
    try:
        engine = client.app[ENGINE]
        first_driver = engine.driver_pid
        assert first_driver is not None and first_driver != os.getpid()
        resp = await client.post(
            "/v1/calls", data=await peer.offer(), headers={"Content-Type": "application/sdp"}
        )
        assert resp.status == 201, await resp.text()
        call_id = resp.headers["Location"].rsplit("/", 1)[1]
        await peer.accept(await resp.text())
        await peer.wait_open()

        resp = await speak(client, call_id, LONG_TEXT)
        assert resp.status == 202, await resp.text()
        playing = (await resp.json())["utterance_id"]
        await peer.wait_event("speech.started", timeout_s=20, utterance_id=playing)

        import psutil

        await asyncio.to_thread(cluster.stop)
        error = await peer.wait_event("error", timeout_s=20, utterance_id=playing)
        assert error["code"] == "engine_lost", error  # never silence

        for _ in range(300):  # the driver ends once its probes and the GCS go unanswered
            if not psutil.pid_exists(first_driver):
                break
            await asyncio.sleep(0.1)
        assert not psutil.pid_exists(first_driver), "the first driver process outlived its cluster"
        resp = await speak(client, call_id, "During the outage.")
        assert resp.status == 503, await resp.text()
        assert (await resp.json())["error"]["code"] == "engine_unavailable"
        assert resp.headers["Retry-After"] == str(config.ray.retry_after_s)
        assert (await client.get(f"/v1/calls/{call_id}")).status == 200  # the call is still up
        ready = await client.get("/readyz")
        assert ready.status == 503
        reason = (await ready.json())["reason"]
        assert "Ray" in reason and "reconnecting" in reason, reason

        await asyncio.to_thread(cluster.start)
        restarted = time.monotonic()
        statuses = []
        while True:  # the front-end reconnects by itself: 503 until then, then 202
            resp = await speak(client, call_id, "After the restart.")
            statuses.append(resp.status)
            if resp.status == 202:
                break
            assert resp.status == 503, await resp.text()
            assert time.monotonic() - restarted < 90, statuses
            await asyncio.sleep(0.1)
        now = time.monotonic()
        logger.info(
            "cluster restart: ray start -> first 202 %.2f s, app deployed -> first 202 %.2f s (%d x 503)",
            now - cluster.head_started_s,
            now - restarted,
            len(statuses) - 1,
        )
        uid = (await resp.json())["utterance_id"]
        done = await peer.wait_event("speech.done", timeout_s=30, utterance_id=uid)
        assert done["played_ms"] > 0, done
        assert engine.driver_pid not in (None, first_driver)
        assert engine.reconnects, "the reconnect was not recorded"
        assert (await client.get("/readyz")).status == 200
    finally:
        await peer.close()
        await client.close()
