"""The front-end's Ray driver, in a child process: `python -m voicertc.remote.driver FD`.

Ray's driver ends its own process when the raylet it joined dies (the cluster stopped) or the GCS stays
away past Ray's reconnect timeout. So the front-end never joins the cluster itself: this child does,
and the front-end (`voicertc.remote.link.DriverLink`) talks to it over a socketpair (`FD`), one pickled
frame per message (`multiprocessing.connection.Connection`). When the child dies, the front-end answers
503 meanwhile and starts a new one (`RemoteEngine`).

Front-end -> driver:
  ("hello", ray_config: dict, client_version: str)   first frame
  ("ask", request_id, method, kwargs)                 one replica method call (info, voices, control, ...)
  ("stream", stream_id, kwargs)                       one utterance: `EngineReplica.stream(**kwargs)`
  ("cancel", stream_id)                               the front-end is done with it (it frees the replica)
  ("forget", replica | None, session)                 the front-end lost this replica under `session`
  ("forget_session", session)                         the call ended: drop its pin
  ("stop",)
Driver -> front-end:
  ("ready", info) | ("failed", code, message)         after joining the cluster and asking a replica
  ("reply", request_id, True, result) | ("reply", request_id, False, error)
  ("msgs", [(stream_id, message), ...])               `voicertc.remote.wire` messages of the streams,
                                                      in order (what piled up in one loop turn)
  ("end", stream_id, error | None)                    the stream ended (None: after its terminal event)
  ("health", {"available", "reason", "voices", "features", "avoided"})   after each probe round
  ("log", level, logger name, text)                   the child's log records, logged by the front-end
`error` is (Ray's exception type name, its text, the caller-facing reason) (see `unavailable_because`).

The session pins, per-replica health and loads (`voicertc.remote.affinity`) live here, beside the
router that reads them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any

from voicertc import __version__
from voicertc.config import RayConfig
from voicertc.errors import EngineUnavailableError
from voicertc.remote import affinity
from voicertc.remote.connect import connect_ray, gcs_answer
from voicertc.remote.wire import PROTOCOL, check_versions

logger = logging.getLogger(__name__)

ErrorInfo = tuple[str, str, str]
ERROR_TEXT_CHARS = 4000  # Ray's account of a failure, for the front-end's log
EXIT_CLUSTER_GONE = 3  # the GCS stopped answering: this driver ends, the front-end starts a new one
VOICE_TIMEOUT_S = 120.0  # registering a voice computes its features on a replica (CPU: seconds)


class _Forward(logging.Handler):
    """This process's log records go to the front-end (its handlers, its format)."""

    def __init__(self, send: Any) -> None:
        super().__init__(logging.INFO)
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._send(("log", record.levelno, record.name, record.getMessage()))
        except Exception:  # noqa: BLE001 - the front-end is gone; nothing to tell
            pass


class Driver:
    """Joins the cluster, serves the front-end's requests against the engine app, probes replicas."""

    def __init__(self, conn: Connection, ray_config: RayConfig, client_version: str) -> None:
        self.conn = conn
        self.ray = ray_config
        self.client_version = client_version
        self._send_lock = threading.RLock()  # a log record may be sent from within a send
        self._handle: Any = None
        self._stream_handle: Any = None
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._gens: dict[str, Any] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopped: asyncio.Event | None = None
        self.gcs_address = ""
        self._outbox: list[tuple[str, Any]] = []  # stream messages of this loop turn (one frame)

    def send(self, frame: tuple[Any, ...]) -> None:
        with self._send_lock:
            self.conn.send(frame)

    async def run(self) -> int:
        self._stopped = asyncio.Event()
        try:
            await asyncio.to_thread(connect_ray, self.ray)
            import ray

            self.gcs_address = str(ray.get_runtime_context().gcs_address)
            info = await self._connect()
        except EngineUnavailableError as exc:
            self.send(("failed", exc.code, str(exc)))
            return 1
        self.send(("ready", info))
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, args=(loop,), name="voicertc-driver-read", daemon=True).start()
        health = loop.create_task(self._health_loop())
        await self._stopped.wait()
        health.cancel()
        for task in list(self._streams.values()) + list(self._tasks):
            task.cancel()
        return 0

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        """Frames from the front-end, onto the loop; end of the pipe (the front-end is gone) stops."""
        while True:
            try:
                frame = self.conn.recv()
            except (EOFError, OSError):
                frame = ("stop",)
            loop.call_soon_threadsafe(self._on_frame, frame)
            if frame[0] == "stop":
                return

    def _on_frame(self, frame: tuple[Any, ...]) -> None:
        kind = frame[0]
        if kind == "ask":
            self._spawn(self._answer(frame[1], frame[2], frame[3]))
        elif kind == "stream":
            self._streams[frame[1]] = asyncio.get_running_loop().create_task(self._stream(frame[1], frame[2]))
        elif kind == "cancel":
            self._cancel(frame[1])
        elif kind == "forget":
            replica = frame[1] or affinity.pinned_replica(frame[2])
            if replica is not None:
                affinity.forget_replica(replica)
        elif kind == "forget_session":
            affinity.forget_session(frame[1])
        elif kind == "stop" and self._stopped is not None:
            self._stopped.set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self) -> dict[str, Any]:
        from ray import serve

        where = f"app {self.ray.app_name!r} on the Ray cluster at {self.ray.address!r}"
        try:
            self._handle = serve.get_app_handle(self.ray.app_name)
            self._stream_handle = self._handle.options(stream=True)
            async with asyncio.timeout(self.ray.connect_timeout_s):
                info: dict[str, Any] = await self._handle.info.remote()
        except TimeoutError:
            raise EngineUnavailableError(
                f"the engine {where} did not answer within {self.ray.connect_timeout_s:g} s "
                "(ray.connect_timeout_s)"
            ) from None
        except Exception as exc:  # noqa: BLE001 - Ray raises many types; all mean "not there"
            raise EngineUnavailableError(f"cannot reach the engine {where}: {exc}") from exc
        if skew := check_versions(info, self.client_version, PROTOCOL):
            skew_error = EngineUnavailableError(skew)
            skew_error.code = "version_skew"
            raise skew_error
        return info

    async def ask(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """One call to a replica method within `timeout_s` (`ray.control_timeout_s`). A call that
        fails or times out is cancelled in Serve too: one routed to a replica that is gone would
        otherwise wait in the router for it forever."""
        response = getattr(self._handle, method).remote(**kwargs)
        try:
            async with asyncio.timeout(timeout_s or self.ray.control_timeout_s):
                return await response
        except BaseException:
            response.cancel()
            raise

    async def _answer(self, request_id: int, method: str, kwargs: dict[str, Any]) -> None:
        own: dict[str, Callable[..., Awaitable[Any]]] = {
            "register_voice": self._register_everywhere,
            "delete_voice": self._delete_everywhere,
            "replica_infos": self._replica_infos,
        }
        try:
            if method in own:
                kwargs.pop("timeout_s", None)  # its own steps have their own deadlines
                result = await own[method](**kwargs)
            else:
                result = await self.ask(method, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the asker
            self.send(("reply", request_id, False, self._error(exc)))
            return
        self.send(("reply", request_id, True, result))

    async def _register_everywhere(self, **kwargs: Any) -> dict[str, Any]:
        """Features computed once, on one replica (it stores the voice in its voices_dir); its files
        then go to every other replica, which loads them. A replica that misses it is named in the log
        (it loads the voice from a shared voices_dir when it restarts)."""
        answer: dict[str, Any] = await self.ask("register_voice", timeout_s=VOICE_TIMEOUT_S, **kwargs)
        if "error" in answer:
            return answer
        voice_id = str(answer["info"]["id"])
        others = [r for r in affinity.known_replicas(self.ray.app_name) if r != answer["replica"]]
        loads = await asyncio.gather(
            *(
                self.ask(
                    "load_voice",
                    timeout_s=VOICE_TIMEOUT_S,
                    replica=r,
                    voice_id=voice_id,
                    files=answer["files"],
                )
                for r in others
            ),
            return_exceptions=True,
        )
        for replica, load in zip(others, loads, strict=True):
            if not isinstance(load, dict) or "error" in load:
                logger.warning("voice %s: replica %s did not load it: %s", voice_id, replica, load)
        logger.info(
            "voice %s registered on replica %s, loaded on %d more", voice_id, answer["replica"], len(others)
        )
        return {"info": answer["info"], "replicas": 1 + len(others)}

    async def _delete_everywhere(self, voice_id: str) -> dict[str, Any]:
        """Delete on every replica: done when one had it; its error when none did."""
        replicas: list[str | None] = list(affinity.known_replicas(self.ray.app_name)) or [None]
        routes: list[dict[str, Any]] = [{"replica": r} if r else {} for r in replicas]
        answers: list[dict[str, Any]] = list(
            await asyncio.gather(*(self.ask("delete_voice", voice_id=voice_id, **route) for route in routes))
        )
        errors = [a["error"] for a in answers if "error" in a]
        if len(errors) < len(answers):
            return {}
        read_only = [e for e in errors if e["kind"] != "unknown_voice"]
        return {"error": (read_only or errors)[0]}

    async def _replica_infos(self) -> dict[str, dict[str, Any]]:
        """Every known replica's info, by replica id (operators, tests)."""
        replicas = affinity.known_replicas(self.ray.app_name)
        infos = await asyncio.gather(
            *(self.ask("info", replica=r, front_end=affinity.FRONT_END) for r in replicas),
            return_exceptions=True,
        )
        return {r: i for r, i in zip(replicas, infos, strict=True) if isinstance(i, dict)}

    def _error(self, exc: BaseException) -> ErrorInfo:
        return (type(exc).__name__, str(exc)[:ERROR_TEXT_CHARS], unavailable_because(self.ray, exc))

    async def _stream(self, stream_id: str, kwargs: dict[str, Any]) -> None:
        """Relay one utterance's messages; its replica counts it as load until the terminal event."""
        counted: str | None = None
        error: ErrorInfo | None = None
        try:
            gen = self._gens[stream_id] = self._stream_handle.stream.remote(
                **kwargs, front_end=affinity.FRONT_END
            )
            async for message in gen:
                if message[0] == "open" and counted is None:
                    counted = str(message[1]["replica"])
                    affinity.utterance_opened(counted)
                self._relay(stream_id, message)
                if _terminal(message):
                    break
        except asyncio.CancelledError:
            return
        except Exception as exc:  # noqa: BLE001 - a dead or drained replica: the front-end decides
            error = self._error(exc)
        finally:
            if counted is not None:
                affinity.utterance_closed(counted)  # ended: it stops counting at once
            self._streams.pop(stream_id, None)
            self._gens.pop(stream_id, None)
        self._flush_outbox()  # its messages before its end
        self.send(("end", stream_id, error))

    def _relay(self, stream_id: str, message: tuple[Any, ...]) -> None:
        """Stream messages leave together at the end of this loop turn: one frame, one wake-up of the
        front-end's reader, however many streams had a piece."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush_outbox)
        self._outbox.append((stream_id, message))

    def _flush_outbox(self) -> None:
        batch, self._outbox = self._outbox, []
        if batch:
            self.send(("msgs", batch))

    def _cancel(self, stream_id: str) -> None:
        gen = self._gens.pop(stream_id, None)
        if gen is not None:
            try:
                gen.cancel()
            except Exception:  # noqa: BLE001 - already finished or torn down
                logger.debug("stream %s: cancel failed", stream_id, exc_info=True)
        task = self._streams.pop(stream_id, None)
        if task is not None:
            task.cancel()

    async def _health_loop(self) -> None:
        """Probe every replica (exact routing) each `health_interval_s`: a replica that does not answer
        is avoided, one that answers again takes new calls again, and their reported loads feed the
        router. The engine is unavailable only while no replica answers."""
        while True:
            await self._probe_replicas()
            await asyncio.sleep(self.ray.health_interval_s)

    async def _probe_replicas(self) -> None:
        replicas = affinity.known_replicas(self.ray.app_name)
        targets: list[str | None] = list(replicas) or [None]  # None: any replica (none known yet)
        results = await asyncio.gather(*(self._probe(rid) for rid in targets), return_exceptions=True)
        answers = [r for r in results if isinstance(r, dict)]
        health: dict[str, Any] = {"available": True, "reason": "", "avoided": affinity.avoided_replicas()}
        if not answers:
            failure = next((r for r in results if isinstance(r, BaseException)), None)
            if failure is None:
                return
            if await asyncio.to_thread(gcs_answer, self.gcs_address, 2.0) == "unreachable":
                self._end_cluster_gone()
            if not _app_missing(failure) and not await asyncio.to_thread(_app_deployed, self.ray.app_name):
                failure = LookupError(f"Application {self.ray.app_name!r} does not exist")  # not a timeout
            health.update(available=False, reason=unavailable_because(self.ray, failure))
            health["detail"] = f"{type(failure).__name__}: {str(failure)[:ERROR_TEXT_CHARS]}"
        else:
            info = answers[0]
            if skew := check_versions(info, self.client_version, PROTOCOL):
                health.update(available=False, reason=skew)
            health.update(voices=list(info.get("voices", [])), features=list(info.get("features", [])))
        self.send(("health", health))

    async def _probe(self, replica: str | None) -> dict[str, Any]:
        """One replica's info (or any replica's, for None); marks that replica healthy or avoided."""
        routing: dict[str, Any] = {"replica": replica} if replica is not None else {}
        try:
            info: dict[str, Any] = await self.ask("info", front_end=affinity.FRONT_END, **routing)
        except Exception as exc:
            if replica is not None and not affinity.avoided(replica):
                affinity.forget_replica(replica)
                logger.warning(
                    "remote engine %s: replica %s missed its health probe, avoided until it answers (%s)",
                    self.ray.app_name,
                    replica,
                    type(exc).__name__,
                )
            raise
        answered = str(info.get("replica", replica or ""))
        if answered:
            if affinity.recovered(answered):
                logger.info(
                    "remote engine %s: replica %s answers again; it takes new calls",
                    self.ray.app_name,
                    answered,
                )
            affinity.report_load(answered, int(info.get("others_open", 0)))
        return info

    def _end_cluster_gone(self) -> None:
        """No replica answers and the cluster's GCS does not either: the cluster stopped. Ray would end
        this process later (raylet gone) or keep it waiting; end it now, so the front-end starts a
        new driver that joins the cluster when it is back."""
        logger.warning(
            "the Ray cluster's GCS at %s does not answer: this driver process ends (the front-end "
            "starts a new one)",
            self.gcs_address,
        )
        os._exit(EXIT_CLUSTER_GONE)


def _terminal(message: tuple[Any, ...]) -> bool:
    if message[0] == "batch":
        return any(part[0] == "event" for part in message[1])
    return bool(message[0] == "event")


def unavailable_because(ray: RayConfig, exc: BaseException) -> str:
    """The caller-facing reason the app does not answer, from Ray's exception (no Ray internals)."""
    app = ray.app_name
    if isinstance(exc, TimeoutError):
        return f"the engine app {app!r} did not answer within {ray.control_timeout_s:g} s"
    if _app_missing(exc):
        return (
            f"the engine app {app!r} is not deployed on the Ray cluster at {ray.address!r}; "
            f"deploy it: voicertc engine-serve --app-name {app} --detach"
        )
    return f"the engine app {app!r} is unavailable ({type(exc).__name__}); details in the log"


def _app_deployed(app: str) -> bool:
    """Serve's controller lists the app (True when it cannot be asked: the probe's reason stands)."""
    try:
        from ray import serve

        return app in serve.status().applications
    except Exception:  # noqa: BLE001 - the controller is away too: keep the probe's own reason
        return True


def _app_missing(exc: BaseException) -> bool:
    """Ray says the app or its deployment is gone (deleted, never deployed); its message is terse."""
    text = str(exc)
    return (
        type(exc).__name__ in ("DeploymentUnavailableError",)
        or "does not exist" in text
        or (text.startswith("Deployment(name="))
    )


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[1]))
    hello = conn.recv()
    if hello[0] != "hello":
        return 2
    driver = Driver(conn, RayConfig(**hello[1]), str(hello[2]) or __version__)
    root = logging.getLogger()
    root.handlers[:] = [_Forward(driver.send)]
    root.setLevel(logging.INFO)
    for noisy in ("ray", "ray.serve"):  # Ray's own chatter stays in Ray's log files
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return asyncio.run(driver.run())


if __name__ == "__main__":
    sys.exit(main(sys.argv))
