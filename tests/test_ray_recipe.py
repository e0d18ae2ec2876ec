"""README's one-machine recipe, run as written: `voicertc engine-serve --local --model fake` and
`voicertc serve --engine ray` as real processes (own HOME, so Ray's token file is the recipe's own).

Proves: the commands work as the README writes them; every socket of the cluster and the front-end is
on 127.0.0.1; the front-end is ready, lists and describes the replicas' voices and speaks through them;
the replicas' metrics are on Ray's endpoint under the names README gives; Ctrl-C stops that cluster.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("ray") is None:
    pytest.skip("needs the scale extra (ray[serve])", allow_module_level=True)

from ray_helpers import LOOPBACK, assert_loopback_only, listening_addresses  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RECIPE_HEADING = "**One machine, loopback only**"


def readme_recipe() -> list[str]:
    """The commands of README's one-machine block (comments dropped), exactly as written there."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index(RECIPE_HEADING) :]
    body = block[block.index("```bash\n") + len("```bash\n") :]
    body = body[: body.index("```")]
    commands = [line.split("#", 1)[0].strip() for line in body.splitlines()]
    return [c for c in commands if c]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Process:
    """A command of the recipe, its output collected by a thread (so its pipe never fills)."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str]) -> None:
        self.command = command
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            shlex.split(command),
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return
            assert self.proc.poll() is None, f"{self.command} exited:\n" + self.output()
            time.sleep(0.2)
        raise AssertionError(f"{self.command}: no {text!r} within {timeout_s} s:\n" + self.output())

    def output(self) -> str:
        return "\n".join(self.lines[-60:])

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only what it started
            self.proc.wait(10)
            raise


def get(url: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post_json(url: str, body: dict, timeout_s: float = 60.0) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Iterator[tuple[Process, Process, str]]:
    """Both commands running in a fresh directory with its own HOME (Ray's token file goes there)."""
    commands = readme_recipe()
    assert len(commands) == 2 and commands[0].startswith("voicertc engine-serve"), commands
    work = tmp_path_factory.mktemp("recipe")
    (work / "home").mkdir()
    port = free_port()
    # both commands read ./config.toml: only where the front-end listens is set here
    (work / "config.toml").write_text(f'[server]\nhost = "127.0.0.1"\nport = {port}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(work / "home"), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    env["PYTHONPATH"] = str(ROOT)  # this checkout's voicertc, whatever the venv's editable install says
    engine = Process(commands[0], work, env)
    front: Process | None = None
    try:
        engine.wait_for("deployed", 180)
        front = Process(commands[1], work, env)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError):
                if get(f"{base}/readyz", 2.0)[0] == 200:
                    break
            assert front.proc.poll() is None, front.output()
            assert time.monotonic() < deadline, front.output()
            time.sleep(0.5)
        yield engine, front, base
    finally:
        if front is not None:
            front.stop()
        engine.stop()


def test_every_socket_of_the_recipe_is_on_loopback(recipe):
    engine, front, _base = recipe
    assert_loopback_only(engine.proc.pid, include_self=True)
    front_sockets = listening_addresses(front.proc.pid, include_self=True)
    assert front_sockets, "the front-end listens somewhere"
    outward = {name: ips - LOOPBACK for name, ips in front_sockets.items() if ips - LOOPBACK}
    assert not outward, outward


def test_the_front_end_lists_the_replicas_voices_and_speaks(recipe):
    _engine, _front, base = recipe
    status, body = get(f"{base}/v1/voices")
    assert status == 200, body[:2000]
    voices = json.loads(body)["voices"]
    ids = [v["id"] for v in voices]
    assert "tone" in ids, voices  # the fake replica's voices
    status, body = get(f"{base}/v1/voices/tone")
    assert status == 200, body[:2000]
    assert json.loads(body)["id"] == "tone"
    assert get(f"{base}/v1/voices/no-such-voice")[0] == 404
    status, body = post_json(f"{base}/v1/audio/speech", {"input": "Hello there.", "response_format": "wav"})
    assert status == 200, body[:2000]
    assert body[:4] == b"RIFF" and len(body) > 20_000, len(body)  # about a second of 24 kHz audio


def metrics_urls(pid: int) -> list[str]:
    """Every TCP port Ray's processes below `pid` listen on, as /metrics URLs (`--local` without
    `--metrics-port` lets Ray pick the metrics port; which one it is shows by its answer)."""
    import psutil

    ports = set()
    for proc in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            ports |= {c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    return [f"http://127.0.0.1:{port}/metrics" for port in sorted(ports)]


def scrape_voicertc_metrics(urls: list[str]) -> list[str]:
    names: set[str] = set()
    for url in urls:
        with contextlib.suppress(OSError, UnicodeDecodeError, ValueError, http.client.HTTPException):
            status, body = get(url, 3.0)
            if status == 200:
                names |= set(re.findall(r"^(ray_voicertc_\w+)", body.decode(), re.M))
    return sorted(names)


def test_the_replicas_metrics_carry_the_names_readme_gives(recipe):
    engine, _front, base = recipe
    status, _ = post_json(f"{base}/v1/audio/speech", {"input": "Count me.", "response_format": "wav"})
    assert status == 200
    urls = metrics_urls(engine.proc.pid)
    deadline = time.monotonic() + 60  # Ray exports what the replicas recorded every few seconds
    names: list[str] = []
    while time.monotonic() < deadline:
        names = scrape_voicertc_metrics(urls)
        if "ray_voicertc_utterances_total" in names:
            break
        time.sleep(2.0)
    assert "ray_voicertc_utterances_total" in names, names
    assert any(n.startswith("ray_voicertc_ttfa_ms") for n in names), names
    assert "ray_voicertc_open_utterances" in names, names


def test_ctrl_c_stops_that_cluster(recipe):
    """Runs last: stopping `engine-serve` ends every process of its cluster, and only those."""
    import psutil

    engine, front, _base = recipe
    cluster = psutil.Process(engine.proc.pid).children(recursive=True)
    assert cluster
    front.stop()
    assert engine.stop() == 0, engine.output()
    gone, alive = psutil.wait_procs(cluster, timeout=30)
    assert not alive, [p.name() for p in alive]
