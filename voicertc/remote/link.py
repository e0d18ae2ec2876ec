"""The front-end's end of its Ray driver process (`voicertc.remote.driver`): start it, talk to it.

`DriverLink.start()` runs `python -m voicertc.remote.driver FD` in its own session (a Ctrl-C meant for
the front-end does not reach it; it exits when the front-end's end of the socketpair closes), sends it
`[ray]` and waits until it joined the cluster and a replica answered. Then a reader thread hands each
frame to the client loop: replies resolve `ask()`, stream messages feed `LinkStream`s, health reports
and the child's death go to the callbacks. No Ray import here: the front-end process never joins the
cluster, so a stopped cluster cannot end it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from voicertc.config import RayConfig
from voicertc.errors import EngineUnavailableError

logger = logging.getLogger(__name__)

ErrorInfo = tuple[str, str, str]  # Ray's exception type name, its text, the caller-facing reason
START_SLACK_S = 30.0  # beyond ray.connect_timeout_s: the child imports Ray and starts its core worker
ASK_SLACK_S = 5.0  # beyond ray.control_timeout_s (the driver's own deadline for a replica call)
_END = object()


class VersionSkewError(EngineUnavailableError):
    """The engine app runs another voicertc version than this front-end (refused at connect)."""

    code = "version_skew"


class DriverLostError(EngineUnavailableError):
    """The front-end's Ray driver process exited (the cluster stopped, or it was killed)."""


class RemoteCallError(Exception):
    """A replica call failed in the driver: Ray's exception type and text, and the caller's reason."""

    def __init__(self, error: ErrorInfo) -> None:
        self.type_name, self.text, self.reason = error
        super().__init__(f"{self.type_name}: {self.text}")


class LinkStream:
    """One utterance's messages, as the driver relays them; `cancel()` frees it on the replica."""

    def __init__(self, link: DriverLink, stream_id: str) -> None:
        self.link = link
        self.stream_id = stream_id
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def __aiter__(self) -> LinkStream:
        return self

    async def __anext__(self) -> tuple[Any, ...]:
        item = await self.queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        message: tuple[Any, ...] = item
        return message

    def cancel(self) -> None:
        self.link.cancel_stream(self.stream_id)


class DriverLink:
    """One driver process and the frames to and from it. `on_health(report)` and `on_lost(reason)`
    run on `loop` (the client loop); `ask`/`stream` are called there too."""

    def __init__(
        self,
        ray_config: RayConfig,
        client_version: str,
        loop: asyncio.AbstractEventLoop,
        on_health: Callable[[dict[str, Any]], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self.ray = ray_config
        self.client_version = client_version
        self.loop = loop
        self.on_health = on_health
        self.on_lost = on_lost
        self.proc: subprocess.Popen[bytes] | None = None
        self.alive = False
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[str, LinkStream] = {}
        self._closing = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    # --- lifecycle (blocking; off the client loop) ---------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Start the driver and wait until a replica answered; its info. Raises EngineUnavailableError
        (or VersionSkewError) with the driver's reason, after ending the process."""
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": _python_path()}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "voicertc.remote.driver", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self._conn = conn = Connection(ours.detach())
        try:
            conn.send(("hello", dataclasses.asdict(self.ray), self.client_version))
            info = self._wait_ready(conn, self.ray.connect_timeout_s + START_SLACK_S)
        except BaseException:
            self.close()
            raise
        self.alive = True
        threading.Thread(target=self._read, name="voicertc-driver-link", daemon=True).start()
        logger.info("remote engine %s: Ray driver process %d joined the cluster", self.ray.app_name, self.pid)
        return info

    def _wait_ready(self, conn: Connection, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0 or not conn.poll(left):
                    raise EngineUnavailableError(
                        f"the Ray driver process did not join the cluster at {self.ray.address!r} "
                        f"within {timeout_s:g} s (ray.connect_timeout_s)"
                    )
                frame = conn.recv()
            except (EOFError, OSError):
                raise DriverLostError(self._exit_reason("before joining the cluster")) from None
            if frame[0] == "log":
                _log(frame)
            elif frame[0] == "ready":
                return dict(frame[1])
            elif frame[0] == "failed":
                error = VersionSkewError if frame[1] == VersionSkewError.code else EngineUnavailableError
                raise error(str(frame[2]))

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask the driver to leave the cluster and end (one still joining is killed at once); kill it
        when it does not."""
        self._closing = True
        joined, self.alive = self.alive, False
        self.send(("stop",))
        proc = self.proc
        if proc is not None:
            try:
                proc.wait(timeout_s if joined else 0.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        if self._conn is not None:
            self._conn.close()

    def _exit_reason(self, when: str) -> str:
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                code = None
        return (
            f"the front-end's Ray driver process exited (status {code}) {when}; the Ray cluster at "
            f"{self.ray.address!r} stopped or cannot be reached"
        )

    # --- frames --------------------------------------------------------------------------------------

    def send(self, frame: tuple[Any, ...]) -> None:
        """Any thread; a frame to a driver that is gone is dropped (its end is noticed by the reader)."""
        conn = self._conn
        if conn is None:
            return
        with self._send_lock:
            try:
                conn.send(frame)
            except (OSError, ValueError):
                pass

    def _read(self) -> None:
        conn = self._conn
        assert conn is not None
        while True:
            try:
                frame = conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 - a frame that does not unpickle: this driver is unusable
                logger.exception("remote engine %s: unreadable frame from the Ray driver", self.ray.app_name)
                if self.proc is not None:
                    self.proc.kill()
                break
            if frame[0] == "log":
                _log(frame)
            else:
                self._post(self._on_frame, frame)
        if not self._closing:
            reason = self._exit_reason("while the front-end was running")
            self._post(self._on_eof, reason)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the client loop is closed: the engine stopped

    def _on_frame(self, frame: tuple[Any, ...]) -> None:
        kind = frame[0]
        if kind == "reply":
            future = self._pending.pop(frame[1], None)
            if future is not None and not future.done():
                if frame[2]:
                    future.set_result(frame[3])
                else:
                    future.set_exception(RemoteCallError(frame[3]))
        elif kind == "msgs":
            for stream_id, message in frame[1]:
                if (stream := self._streams.get(stream_id)) is not None:
                    stream.queue.put_nowait(message)
        elif kind == "end":
            if (stream := self._streams.pop(frame[1], None)) is not None:
                error = frame[2]
                stream.queue.put_nowait(_END if error is None else RemoteCallError(error))
        elif kind == "health":
            self.on_health(dict(frame[1]))

    def _on_eof(self, reason: str) -> None:
        self.alive = False
        for future in self._pending.values():
            if not future.done():
                future.set_exception(DriverLostError(reason))
        self._pending.clear()
        for stream in self._streams.values():
            stream.queue.put_nowait(DriverLostError(reason))
        self._streams.clear()
        self.on_lost(reason)

    # --- calls (client loop) -------------------------------------------------------------------------

    async def ask(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """A replica method's answer within `timeout_s` (`ray.control_timeout_s`; the driver applies
        it); RemoteCallError when it failed, DriverLostError when the driver is gone."""
        if not self.alive:
            raise DriverLostError("the front-end's Ray driver process is not running")
        request_id = next(self._ids)
        future = self.loop.create_future()
        self._pending[request_id] = future
        if timeout_s is not None:
            kwargs["timeout_s"] = timeout_s
        self.send(("ask", request_id, method, kwargs))
        try:
            async with asyncio.timeout((timeout_s or self.ray.control_timeout_s) + ASK_SLACK_S):
                return await future
        finally:
            self._pending.pop(request_id, None)

    def stream(self, **kwargs: Any) -> LinkStream:
        stream = LinkStream(self, f"s{next(self._ids)}")
        if not self.alive:
            stream.queue.put_nowait(DriverLostError("the front-end's Ray driver process is not running"))
            return stream
        self._streams[stream.stream_id] = stream
        self.send(("stream", stream.stream_id, kwargs))
        return stream

    def cancel_stream(self, stream_id: str) -> None:
        if self._streams.pop(stream_id, None) is not None:
            self.send(("cancel", stream_id))

    def forget(self, replica: str | None, session: str) -> None:
        self.send(("forget", replica, session))

    def forget_session(self, session: str) -> None:
        self.send(("forget_session", session))


def _log(frame: tuple[Any, ...]) -> None:
    """A log record of the driver process, logged here under its own logger name."""
    logging.getLogger(str(frame[2])).log(int(frame[1]), "[ray driver] %s", frame[3])


def _python_path() -> str:
    """This voicertc first, so the driver runs the same code as the front-end."""
    root = str(Path(__file__).resolve().parents[2])
    rest = os.environ.get("PYTHONPATH", "")
    return root + (os.pathsep + rest if rest else "")
