"""Keep a single-machine Ray cluster on 127.0.0.1 (tests, `engine-serve --local`).

Ray resolves 127.0.0.1 to the host's outward address unless it is told it is not a cluster, and a
Serve replica binds its inter-deployment gRPC server to every interface (`[::]:0`); voicertc calls
replicas through deployment handles, so that server can listen on loopback.
"""

from __future__ import annotations

from typing import Any

SETUP_HOOK = "voicertc.remote.loopback.keep_replica_servers_on_loopback"


def keep_replica_servers_on_loopback() -> None:
    """Ray `worker_process_setup_hook`: replica gRPC servers in this worker bind 127.0.0.1."""
    from ray.serve._private import replica

    original = replica.add_port_to_grpc_server
    if getattr(original, "voicertc_loopback", False):
        return

    def on_loopback(server: Any, address: str) -> Any:
        host, _, port = address.rpartition(":")
        return original(server, f"127.0.0.1:{port}" if host in ("[::]", "0.0.0.0", "") else address)

    on_loopback.voicertc_loopback = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = on_loopback


def loopback_init_options() -> dict[str, Any]:
    """`ray.init` options for a local cluster that binds nothing beyond 127.0.0.1 (call
    `not_a_cluster()` first)."""
    return {
        "include_dashboard": False,
        "_node_ip_address": "127.0.0.1",
        "runtime_env": {"worker_process_setup_hook": SETUP_HOOK},
    }


def not_a_cluster() -> bool:
    """Make this process's Ray keep 127.0.0.1 as the node address; returns the previous setting."""
    from ray._private import ray_constants

    previous = bool(ray_constants.ENABLE_RAY_CLUSTER)
    ray_constants.ENABLE_RAY_CLUSTER = False
    return previous
