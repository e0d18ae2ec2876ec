"""The Ray test modules' shared parts: a local loopback cluster with the fake and tiny-CosyVoice2 engine
apps, front-end configs, `RemoteEngine`s, and a ring read at playout pace (Ray imported when used)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from call_helpers import fake_config
from cv2_engine_helpers import make_tiny_model_dir

from voicertc.assemble import create_local_engine
from voicertc.audio import PcmRing, RingSink
from voicertc.config import Config, RayConfig
from voicertc.engine.protocol import Cancelled, Done, EngineEvent, Failed, FirstAudio
from voicertc.remote.client import RemoteEngine, apply_auth
from voicertc.remote.deployment import build_app
from voicertc.remote.loopback import loopback_init_options, not_a_cluster

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


_TOKEN: list[Path] = []  # the session's one token file


def session_token(tmp_path_factory: Any) -> Path:
    """One token file for every in-process cluster of the session: Ray keeps the first token it read
    for the life of the process, so a second module's cluster with a new token would refuse its own
    driver ("InvalidAuthToken" as its GCS starts)."""
    if not _TOKEN:
        path = tmp_path_factory.mktemp("ray") / "auth_token"
        path.write_text(secrets.token_hex(32))
        _TOKEN.append(path)
    return _TOKEN[0]


@contextlib.contextmanager
def local_cluster(tmp_path_factory: Any, tiny_model_dir: Path, cv2_replicas: int) -> Iterator[Path]:
    """A local Ray cluster on 127.0.0.1 with the two engine apps (two fake replicas, `cv2_replicas`
    tiny CosyVoice2 ones sharing `voices_dir_of(...)`), torn down at the end; yields the speaking tiny
    CosyVoice2 directory the cv2 app runs. Ray is imported here, not at collection."""
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", NOT_A_CLUSTER)}
    # Ray swaps 127.0.0.1 for the host's outward address unless told this is no cluster: keep every
    # process of the test cluster (GCS, raylet, workers, agents) on loopback (also `not_a_cluster()`).
    os.environ[NOT_A_CLUSTER] = "0"
    import ray
    from ray import serve

    speaking_dir = make_tiny_model_dir(tmp_path_factory.mktemp("cv2_speak"), checkpoints_from=tiny_model_dir)
    voices_dir = voices_dir_of(speaking_dir)
    token = session_token(tmp_path_factory)
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
            ray={"num_replicas": cv2_replicas, "num_cpus": 0.5},
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
