"""Where a voicertc Ray cluster listens: nothing beyond the node's own address.

- One machine (`engine-serve --local`, the tests, the bench): every Ray process on 127.0.0.1. Ray swaps
  127.0.0.1 for the host's outward address unless it is told it is not a cluster: `not_a_cluster()` in
  this process, and `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` in the environment its children inherit.
- Every node: a Serve replica binds its inter-deployment gRPC server to every interface (`[::]:0`,
  started after the replica's constructor); voicertc calls replicas through deployment handles, so
  `EngineReplica.__init__` calls `bind_replica_servers_to_the_node_address()` to bind it to the node's
  address instead. (A `worker_process_setup_hook` in a deployment's runtime env is not run: Ray runs
  that hook only from a job's runtime env.)
"""

from __future__ import annotations

import os
from typing import Any

NOT_A_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = "127.0.0.1"
_ANY = ("[::]", "0.0.0.0", "")


def bind_replica_servers_to_the_node_address() -> None:
    """Replica gRPC servers in this worker process bind the node's address (the one
    `ray start --node-ip-address` or `--local` gave it), never every interface."""
    from ray.serve._private import replica

    original = replica.add_port_to_grpc_server
    if getattr(original, "voicertc_node_address", False):
        return

    def on_node_address(server: Any, address: str) -> Any:
        host, _, port = address.rpartition(":")
        if host not in _ANY:
            return original(server, address)
        return original(server, f"{_node_address()}:{port}")

    on_node_address.voicertc_node_address = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = on_node_address


def _node_address() -> str:
    import ray

    node_ip = str(ray.util.get_node_ip_address())
    return f"[{node_ip}]" if ":" in node_ip else node_ip


def loopback_init_options() -> dict[str, Any]:
    """`ray.init` options for a local cluster that binds nothing beyond 127.0.0.1 (call
    `not_a_cluster()` first)."""
    return {"include_dashboard": False, "_node_ip_address": LOOPBACK}


def not_a_cluster() -> bool:
    """Make this process's Ray, and the Ray processes it starts, keep 127.0.0.1 as the node address;
    returns the previous in-process setting."""
    from ray._private import ray_constants

    os.environ[NOT_A_CLUSTER_ENV] = "0"
    previous = bool(ray_constants.ENABLE_RAY_CLUSTER)
    ray_constants.ENABLE_RAY_CLUSTER = False
    return previous
