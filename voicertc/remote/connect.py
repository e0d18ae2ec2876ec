"""Joining the Ray cluster as a driver: token auth, "auto" addresses, the GCS probe that tells a
rejected token from an unreachable address. Runs in the front-end's driver process
(`voicertc.remote.driver`) and in `voicertc engine-serve`; Ray is imported inside the functions.
"""

from __future__ import annotations

import logging
import os
import threading

from voicertc.config import RayConfig
from voicertc.errors import EngineUnavailableError

logger = logging.getLogger(__name__)


def apply_auth(ray_config: RayConfig) -> None:
    """Set Ray's token-auth environment from `[ray]` (before `ray.init` / `ray start`).

    Ray reads RAY_AUTH_MODE / RAY_AUTH_TOKEN_PATH into its cached config when it is imported; the
    cache is refreshed here the way Ray itself does when it turns token auth on."""
    os.environ["RAY_AUTH_MODE"] = ray_config.auth_mode
    if ray_config.auth_token_path:
        os.environ["RAY_AUTH_TOKEN_PATH"] = ray_config.auth_token_path
    try:
        from ray._raylet import Config as RayletConfig  # type: ignore[attr-defined]

        RayletConfig.initialize("")
    except Exception:  # noqa: BLE001 - a Ray without this hook reads the environment at init
        logger.debug("could not refresh Ray's cached config", exc_info=True)


def _loopback_cluster(address: str) -> bool:
    """The cluster runs on this machine's 127.0.0.1 (`engine-serve --local`, or "auto" finding one)."""
    address = _resolve_auto(address)
    host = address.removeprefix("ray://").rpartition(":")[0] or address
    return host in ("127.0.0.1", "localhost", "[::1]")


def _resolve_auto(address: str) -> str:
    """The address "auto" stands for (RAY_ADDRESS, else the one local cluster, else the last `ray start`
    cluster); '' when that finds none or several. Other addresses unchanged."""
    if address != "auto":
        return address
    from ray._private import services, utils

    if env := os.environ.get("RAY_ADDRESS"):
        return env
    running = sorted(services.find_gcs_addresses())
    if len(running) == 1:
        return str(running[0])
    latest = utils.read_ray_address(None)  # the last `ray start` here (a stale file names a dead one)
    return str(latest) if latest in running else ""


def connect_ray(ray_config: RayConfig) -> bool:
    """Join the cluster as a driver (unless this process already did); True when this call did.

    Token auth follows `ray.auth_mode` / `ray.auth_token_path` (Ray reads them from the environment).
    An unreachable address raises EngineUnavailableError naming it, within `ray.connect_timeout_s`.
    """
    import ray

    if ray.is_initialized():
        return False
    apply_auth(ray_config)
    if _loopback_cluster(ray_config.address):
        from voicertc.remote.loopback import not_a_cluster

        not_a_cluster()  # else Ray swaps 127.0.0.1 for this host's outward address and cannot connect
    if gcs_answer(ray_config.address) == TOKEN_REJECTED:
        raise EngineUnavailableError(token_rejected_message(ray_config))
    error: list[BaseException] = []

    def init() -> None:
        try:
            ray.init(
                address=ray_config.address,
                namespace=ray_config.namespace,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        except BaseException as exc:  # noqa: BLE001 - re-raised below with the address
            error.append(exc)

    thread = threading.Thread(target=init, name="voicertc-ray-init", daemon=True)
    thread.start()
    thread.join(ray_config.connect_timeout_s)
    if thread.is_alive() or error:
        if gcs_answer(ray_config.address) == TOKEN_REJECTED:  # the token may have changed meanwhile
            raise EngineUnavailableError(token_rejected_message(ray_config))
    if thread.is_alive():
        raise EngineUnavailableError(
            f"cannot reach the Ray cluster at {ray_config.address!r} within "
            f"{ray_config.connect_timeout_s:g} s (ray.address, ray.connect_timeout_s)"
        )
    if error:
        raise EngineUnavailableError(
            f"cannot reach the Ray cluster at {ray_config.address!r} (ray.address): {error[0]}"
        ) from error[0]
    return True


TOKEN_REJECTED = "token_rejected"


def token_rejected_message(ray_config: RayConfig) -> str:
    where = ray_config.auth_token_path or "RAY_AUTH_TOKEN / ~/.ray/auth_token"
    return (
        f"the Ray cluster at {ray_config.address!r} answered but token rejected: this front-end's token "
        f"({where}; ray.auth_token_path) is not the cluster's; copy the head node's token file"
    )


def gcs_answer(address: str, timeout_s: float = 3.0) -> str:
    """Ask the cluster's GCS for its id with this process's token: "ok", `TOKEN_REJECTED`,
    "unreachable", or "unknown" (a `ray://` client address, or no single local cluster for "auto")."""
    import grpc  # type: ignore[import-untyped]
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    address = _resolve_auto(address)
    if address.startswith("ray://") or ":" not in address:
        return "unknown"
    channel = init_grpc_channel(address)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)  # type: ignore[attr-defined]
        return "ok"
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            return TOKEN_REJECTED
        return "unreachable"
    except Exception:  # noqa: BLE001 - a probe only: the connect that follows reports the problem
        logger.debug("GCS probe of %s failed", address, exc_info=True)
        return "unknown"
    finally:
        channel.close()
