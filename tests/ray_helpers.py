"""Helpers for the Ray tests: which addresses a process tree listens on."""

from __future__ import annotations

import contextlib
import socket

LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def listening_addresses(pid: int, include_self: bool = False) -> dict[str, set[str]]:
    """The TCP listening and UDP bound addresses of every process below `pid` (Ray's GCS, raylet,
    agents, workers and replicas are its children), by process name."""
    import psutil

    root = psutil.Process(pid)
    procs = ([root] if include_self else []) + root.children(recursive=True)
    found: dict[str, set[str]] = {}
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN or conn.type == socket.SOCK_DGRAM:
                    found.setdefault(proc.name(), set()).add(conn.laddr.ip)
    return found


def assert_loopback_only(pid: int, include_self: bool = False) -> dict[str, set[str]]:
    """Every Ray process below `pid` listens on loopback only; returns what was seen."""
    found = listening_addresses(pid, include_self)
    assert {"gcs_server", "raylet"} <= set(found), found  # the cluster's processes were seen
    assert any("Replica" in name for name in found), found  # and the replicas' own servers
    outward = {name: ips - LOOPBACK for name, ips in found.items() if ips - LOOPBACK}
    assert not outward, outward
    return found
