"""A real coturn (Debian's `turnserver`) on loopback for the TURN tests and bench.relay_latency: a random
shared secret, free ports, the TURN REST API scheme (`use-auth-secret`), loopback peers allowed (the
server's candidates are 127.0.0.1). `make test` installs the `coturn` package."""

from __future__ import annotations

import contextlib
import random
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TURNSERVER = shutil.which("turnserver") or "/usr/bin/turnserver"
RELAY_SPAN = 64  # relay ports per test server


@dataclass(frozen=True)
class Turn:
    url: str  # turn:127.0.0.1:PORT?transport=udp
    secret: str
    port: int
    relay_ports: tuple[int, int]
    log: Path
    pid: int

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _port_free(port: int) -> bool:
    """Nobody holds `port` on 127.0.0.1 (UDP and TCP). coturn binds with SO_REUSEPORT, so a second
    coturn on a taken port would start and silently share its packets: check first."""
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        with socket.socket(socket.AF_INET, kind) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _free_port() -> int:
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if _port_free(port):
            return port
    raise RuntimeError("no free port for coturn")


def _free_range(span: int) -> tuple[int, int]:
    for _ in range(100):
        low = random.randrange(20000, 30000 - span)
        if all(_port_free(p) for p in (low, low + span // 2, low + span - 1)):
            return low, low + span - 1
    raise RuntimeError("no free relay port range for coturn")


@contextlib.contextmanager
def coturn(start_timeout_s: float = 10.0) -> Iterator[Turn]:
    """coturn on 127.0.0.1 until the block ends (terminated, then killed if it lingers)."""
    secret = secrets.token_hex(16)
    port = _free_port()
    low, high = _free_range(RELAY_SPAN)
    log = Path(tempfile.mkdtemp()) / "turnserver.log"
    args = [
        TURNSERVER,
        "--no-stdout-log",
        f"--log-file={log}",
        "--simple-log",
        "-n",  # no config file
        "--listening-ip=127.0.0.1",
        "--relay-ip=127.0.0.1",
        f"--listening-port={port}",
        f"--min-port={low}",
        f"--max-port={high}",
        "--use-auth-secret",
        f"--static-auth-secret={secret}",
        "--realm=voicertc.test",
        "--allow-loopback-peers",  # the server's host candidates are 127.0.0.1
        "--no-tls",
        "--no-dtls",
        "--no-cli",
        "--no-tcp-relay",
        "--fingerprint",
        f"--pidfile={log.with_suffix('.pid')}",
        f"--userdb={log.with_name('turndb')}",  # its own (empty) user db, not /var/lib/turn's
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + start_timeout_s
        ready = "Relay ports initialization done"
        while ready not in (log.read_text(errors="replace") if log.exists() else ""):
            assert proc.poll() is None, f"turnserver exited with {proc.returncode}"
            assert time.monotonic() < deadline, "turnserver did not start"
            time.sleep(0.05)
        time.sleep(0.1)  # the listeners open right after the relay ports
        yield Turn(f"turn:127.0.0.1:{port}?transport=udp", secret, port, (low, high), log, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
