"""RemoteEngine: the `voicertc.engine.protocol.Engine` seam over the Ray Serve engine deployment.

The front-end's transport (calls, speech queues, rings) is unchanged: it opens utterances, pushes
text and cancels, and PCM arrives in the same `RingSink`. Behind the seam, each utterance is one
streaming call to a replica (`EngineReplica.stream`), pinned per call by `SessionAffinityRouter`.

Process: this front-end never joins the Ray cluster itself. Its Ray driver (the deployment handle, the
router, the health probes) runs in a child process (`voicertc.remote.driver`, reached through
`voicertc.remote.link.DriverLink`), because Ray ends a driver's process when the cluster stops. When
that child dies, open utterances end with `engine_lost`, speak answers 503 `engine_unavailable` with
Retry-After, `/readyz` says why, calls stay up, and a new child is started with a bounded backoff
(`RECONNECT_FIRST_S` doubling up to `ray.retry_after_s`) until the cluster and the app answer again.

Threads: public methods are safe from any thread; they hop onto the client's own event loop thread
("voicertc-remote"), which plays the engine thread's role: it owns the driver link, writes the
sinks (resampling there, off the server's loop) and sends the engine events.

Faults: a replica that dies or drains mid-utterance, or stays silent for `ray.stall_timeout_s` while it
has text and credit, fails the utterance with code `engine_lost` (never silence), and the call's next
utterance goes to another replica. A health probe (in the driver) every `ray.health_interval_s` marks
the engine unavailable while the app cannot be reached: opening an utterance then raises
`EngineUnavailableError` (HTTP 503 + Retry-After); calls stay up.

Flow control: the client reports how much of an utterance has played out of the ring (`played_ms`),
and the replica stays at most `engine.max_ahead_ms` ahead of it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from voicertc import __version__
from voicertc.audio.decode import AudioError
from voicertc.config import Config, RayConfig
from voicertc.engine.delivery import Delivery, Wrote
from voicertc.engine.protocol import (
    AudioSink,
    Cancelled,
    Done,
    EngineEvent,
    EventCallback,
    Failed,
    SpeakOptions,
)
from voicertc.engine.voice_book import VoiceInfo
from voicertc.errors import (
    EngineUnavailableError,
    InputError,
    NotSupportedError,
    UnknownVoiceError,
    VoiceRTCError,
)
from voicertc.remote.connect import apply_auth, connect_ray
from voicertc.remote.driver import VOICE_TIMEOUT_S
from voicertc.remote.link import (
    DriverLink,
    DriverLostError,
    LinkStream,
    RemoteCallError,
    VersionSkewError,
)
from voicertc.remote.wire import pcm_from_message

if TYPE_CHECKING:
    from voicertc.audio.decode import Clip
    from voicertc.engine.batch_stats import BatchStats
    from voicertc.engine.step_stats import StepStats

T = TypeVar("T")

__all__ = ["RemoteEngine", "VersionSkewError", "apply_auth", "connect_ray", "short_message"]

logger = logging.getLogger(__name__)

ENGINE_LOST = "engine_lost"
MAX_MESSAGE_CHARS = 200  # caller-facing error messages: one short, stable line (details go to the log)
MAX_REASON_CHARS = 300  # /readyz and 503 reasons: may name the app, the address and the command to run
REPLICAS_KEPT = 10_000  # utterance id -> replica, for operators and tests
CREDIT_SLACK_MS = 100.0
DELAYS_KEPT = 100_000  # recent per-chunk hop delays (replica on this machine), for bench.remote_load
RECONNECT_FIRST_S = 0.25  # first wait before a new driver process; doubles up to ray.retry_after_s
CLUSTER_LOST = "the connection to the engine cluster was lost"
_HOST = socket.gethostname()


@dataclass(kw_only=True, eq=False)
class _Utterance(Delivery):
    """One remote utterance. Owned by the client loop (`open`/`cancel` counting aside); its audio is
    held and written by the shared delivery outlet (`Delivery`)."""

    voice: str
    on_event: EventCallback
    session: str
    options: SpeakOptions
    outbox: list[str] = field(default_factory=list)
    text_chars: int = 0
    input_ended: bool = False
    end_sent: bool = False
    replica: str | None = None
    received_ms: float = 0.0
    credited_ms: float = 0.0
    done: dict[str, Any] | None = None  # the replica's "done", held until pending PCM is written
    finished: bool = False
    task: asyncio.Task[None] | None = None
    control_task: asyncio.Task[None] | None = None
    gen: LinkStream | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class RemoteEngine:
    """Implements `voicertc.engine.protocol.Engine` with the utterances running on Ray Serve replicas."""

    def __init__(
        self,
        config: Config,
        *,
        client_version: str = __version__,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.ray: RayConfig = config.ray
        self.name = f"ray:{config.ray.app_name}"
        self.default_voice = config.engine.default_voice
        self.max_text_chars = config.limits.max_text_chars
        self._max_utterances = config.limits.max_utterances
        self.max_ahead_ms = float(min(config.engine.max_ahead_ms, config.engine.max_queued_ms))
        self.client_version = client_version
        self.clock = clock
        self.replicas: OrderedDict[str, str] = OrderedDict()  # utterance id -> replica unique id
        self.replica_pids: dict[str, int] = {}  # replica unique id -> its process id (on its node)
        self.chunk_delays_ms: deque[float] = deque(maxlen=DELAYS_KEPT)  # replica write -> here
        self.stats = {"utterances": 0, "done": 0, "cancelled": 0, "failed": 0, "engine_lost": 0}
        self._lock = threading.Lock()
        self._open: set[str] = set()  # counted utterances (until cancel() or their terminal event)
        self._utts: dict[str, _Utterance] = {}  # client loop only
        self._sessions: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._voices: list[str] = []
        self._features: frozenset[str] = frozenset()
        self._available = False
        self._unavailable_reason = "the remote engine is not started"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._link: DriverLink | None = None
        self._starting: DriverLink | None = None  # a driver being started by the reconnect task
        self._reconnect_task: asyncio.Task[None] | None = None
        self._stopping = False
        self.avoided_replicas: frozenset[str] = frozenset()  # the driver's last health report
        self.reconnects: list[float] = []  # seconds from losing the driver to the next one's join
        self._forgotten: deque[str] = deque()  # sessions whose sink was collected (see forget_session)
        self.health_reports = 0  # probe rounds the driver reported (each: every replica asked once)

    # --- lifecycle (blocking; off the server's loop) -------------------------------------------------

    def start(self) -> None:
        """Start the driver process and wait until it joined the cluster and a replica answered;
        raises EngineUnavailableError naming the address (or VersionSkewError naming both versions)."""
        if self._thread is not None:
            return
        self._stopping = False
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="voicertc-remote", daemon=True)
        self._loop = loop
        self._thread.start()
        link = self._new_link()
        try:
            info = link.start()
        except BaseException:
            self.stop()
            raise
        self._link = link
        self._on_info(info)
        self._set_available(True)
        logger.info(
            "remote engine: app %s at %s (model %s, voices %s)",
            self.ray.app_name,
            self.ray.address,
            info.get("model"),
            ", ".join(self._voices),
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Cancel every open utterance, end the driver process and close the client loop (the
        replicas stay up)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._stopping = True
        self._available = False
        self._unavailable_reason = "the remote engine is stopped"
        try:
            self._call(self._shutdown(), timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            logger.exception("remote engine: shutdown failed")
        for link in (self._starting, self._link):
            if link is not None:
                link.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        loop.close()
        self._loop = self._thread = None
        self._link = self._starting = None

    @property
    def driver_pid(self) -> int | None:
        """The process id of the current Ray driver process (None while there is none)."""
        link = self._link
        return link.pid if link is not None and link.alive else None

    def avoided(self, replica: str) -> bool:
        """The driver avoids this replica for new calls (it failed, stalled or missed a probe)."""
        return replica in self.avoided_replicas

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def available(self) -> bool:
        return self.running and self._available

    @property
    def ready(self) -> bool:
        """/readyz: the engine app answers (503 + `not_ready_reason` while it does not)."""
        return self.available

    @property
    def not_ready_reason(self) -> str:
        return "" if self.available else self._unavailable_reason

    @property
    def retry_after_s(self) -> int:
        """`[ray] retry_after_s`: about how long a lost cluster or driver takes to come back."""
        return self.ray.retry_after_s

    @property
    def open_count(self) -> int:
        with self._lock:
            return len(self._open)

    @property
    def max_utterances(self) -> int:
        return self._max_utterances

    def voices(self) -> list[str]:
        return list(self._voices)

    def resolve_voice(self, voice: str | None) -> str:
        """The voice to use; EngineUnavailableError while the app cannot be reached."""
        if not self.available:
            raise EngineUnavailableError(self._unavailable_reason, self.ray.retry_after_s)
        voices = self._voices
        if not voice:
            voice = self.default_voice or (voices[0] if voices else "")
        if voice not in voices:
            raise UnknownVoiceError(f"unknown voice {voice!r}; available: {', '.join(voices) or 'none'}")
        return voice

    # --- the Engine seam (any thread) ----------------------------------------------------------------

    def supports(self, feature: str) -> bool:
        """Whether the replicas honour a speak option ("instruct", "speed"), as their info says."""
        return feature in self._features

    def submit_command(self, fn: Callable[[Any], T]) -> Future[T]:
        """Engine commands run in-process only: the replicas' backends are not reachable from here."""
        return _failed(NotSupportedError("engine commands are not supported by the remote engine"))

    def list_voices(self) -> Future[list[VoiceInfo]]:
        """The voice book of a replica (the replicas of one app run one config: the same voices);
        EngineUnavailableError (503) while the app does not answer."""
        loop = self._loop
        if loop is None or not self.available:
            return _failed(EngineUnavailableError(self._unavailable_reason, self.ray.retry_after_s))
        return asyncio.run_coroutine_threadsafe(self._list_voices(), loop)

    def register_voice(
        self, clip: Clip, transcript: str | None, voice_id: str | None, name: str
    ) -> Future[VoiceInfo]:
        """Register on every replica: one replica computes the voice and stores it in the app's
        `[engine] voices_dir`, the others load its files (`voicertc.remote.driver`). The same errors
        as in-process (voice_exists, bad audio, not_supported for the fake and Piper)."""
        samples = np.ascontiguousarray(clip.samples, dtype="<f4").tobytes()
        request = {
            "samples": samples,
            "sample_rate_hz": int(clip.sample_rate_hz),
            "transcript": transcript,
            "voice_id": voice_id,
            "name": name,
        }
        return self._voice_call(self._register_voice(request))

    def delete_voice(self, voice_id: str) -> Future[None]:
        """Delete on every replica (and from the voices_dir): unknown_voice when none had it."""
        return self._voice_call(self._delete_voice(voice_id))

    def replica_infos(self, timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
        """Each replica's info (version, voices, open utterances), by replica id (blocking)."""
        infos: dict[str, dict[str, Any]] = self._call(self._ask("replica_infos"), timeout_s=timeout_s)
        return infos

    def _voice_call(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        loop = self._loop
        if loop is None or not self.available:
            coro.close()
            return _failed(EngineUnavailableError(self._unavailable_reason, self.ray.retry_after_s))
        return asyncio.run_coroutine_threadsafe(coro, loop)

    @property
    def step_stats(self) -> StepStats | None:
        return None  # the steps run in the replicas (their own metrics)

    @property
    def batch_stats(self) -> BatchStats | None:
        return None

    def open_utterance(
        self,
        voice: str | None,
        sink: AudioSink,
        on_event: EventCallback,
        utterance_id: str | None = None,
        options: SpeakOptions | None = None,
    ) -> str:
        resolved = self.resolve_voice(voice)
        uid = utterance_id or uuid.uuid4().hex[:12]
        with self._lock:
            if len(self._open) >= self._max_utterances:
                raise InputError(f"too many open utterances (limit {self._max_utterances})")
            self._open.add(uid)
            session = self._session_for(sink)
        utt = _Utterance(
            utterance_id=uid,
            voice=resolved,
            sink=sink,
            on_event=on_event,
            generation=sink.generation,
            opened_s=self.clock(),
            session=session,
            options=options or SpeakOptions(),
        )
        self._post(self._begin, utt)
        return uid

    def push_text(self, utterance_id: str, text: str, end: bool = False) -> None:
        self._post(self._push, utterance_id, text, end)

    def end_input(self, utterance_id: str) -> None:
        self._post(self._end, utterance_id)

    def cancel(self, utterance_id: str) -> None:
        with self._lock:
            self._open.discard(utterance_id)
        self._post(self._cancel, utterance_id)

    def say(self, voice: str | None, sink: AudioSink, on_event: EventCallback, text: str) -> str:
        uid = self.open_utterance(voice, sink, on_event)
        self.push_text(uid, text, end=True)
        return uid

    def report(self, utterance_id: str, timeout_s: float = 10.0) -> dict[str, Any] | None:
        """The replica's account of a finished utterance (pieces made, pieces made after cancel)."""
        replica = self.replicas.get(utterance_id)
        if replica is None:
            return None
        result: dict[str, Any] | None = self._call(
            self._ask("report", replica=replica, utterance_id=utterance_id), timeout_s=timeout_s
        )
        return result

    # --- the client loop -----------------------------------------------------------------------------

    def _session_for(self, sink: AudioSink) -> str:
        """One session key per sink (one call's ring), under `_lock`; its pin goes with the sink."""
        session = self._sessions.get(sink)
        if session is None:
            session = uuid.uuid4().hex
            self._sessions[sink] = session
            weakref.finalize(sink, _forget_session, weakref.ref(self), session)
        return session

    def forget_session(self, session: str) -> None:
        """The call's sink is gone: its pin goes too, with the next utterance's frames. Any thread, and
        from a garbage collection that interrupted a send on the client loop: so it only queues."""
        self._forgotten.append(session)

    def _send_forgotten(self) -> None:
        """Client loop: the queued `forget_session`s to the driver."""
        link = self._link
        while self._forgotten and link is not None:
            link.forget_session(self._forgotten.popleft())

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # stopped meanwhile

    def _call(self, coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _new_link(self) -> DriverLink:
        assert self._loop is not None
        return DriverLink(self.ray, self.client_version, self._loop, self._on_health, self._driver_lost)

    def _on_info(self, info: dict[str, Any]) -> None:
        self._voices = list(info.get("voices", []))
        self._features = frozenset(info.get("features", ()))

    async def _ask(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """One call to a replica method, made by the driver within `ray.control_timeout_s` (or
        `timeout_s`, which the driver applies too)."""
        link = self._link
        if link is None:
            raise DriverLostError(self._unavailable_reason, self.ray.retry_after_s)
        return await link.ask(method, timeout_s=timeout_s, **kwargs)

    async def _register_voice(self, request: dict[str, Any]) -> VoiceInfo:
        answer = await self._voice_ask("register_voice", request)
        info: VoiceInfo = answer["info"]
        if info["id"] not in self._voices:
            self._voices = [*self._voices, str(info["id"])]
        logger.info("voice %s registered on %d replica(s)", info["id"], answer.get("replicas", 1))
        return info

    async def _delete_voice(self, voice_id: str) -> None:
        await self._voice_ask("delete_voice", {"voice_id": voice_id})
        self._voices = [v for v in self._voices if v != voice_id]

    async def _voice_ask(self, method: str, request: dict[str, Any]) -> dict[str, Any]:
        """A voice-book call through the driver; a replica's error answer raises its like here."""
        try:
            answer: dict[str, Any] = await self._ask(method, timeout_s=VOICE_TIMEOUT_S, **request)
        except Exception as exc:  # noqa: BLE001 - Ray raises many types; all mean "not answering"
            reason = self._reason_for(exc)
            logger.warning("remote engine %s: %s failed: %s (%s)", self.ray.app_name, method, reason, exc)
            raise EngineUnavailableError(reason, self.ray.retry_after_s) from None
        if "error" in answer:
            raise voice_error(answer["error"])
        return answer

    async def _list_voices(self) -> list[VoiceInfo]:
        try:
            infos: list[VoiceInfo] = await self._ask("voices")
        except Exception as exc:  # noqa: BLE001 - Ray raises many types; all mean "not answering"
            reason = self._reason_for(exc)
            logger.warning("remote engine %s: listing voices failed: %s (%s)", self.ray.app_name, reason, exc)
            raise EngineUnavailableError(reason, self.ray.retry_after_s) from None
        self._voices = [str(info["id"]) for info in infos]
        return infos

    def _reason_for(self, exc: BaseException) -> str:
        """What a caller is told when a replica call failed (no Ray internals)."""
        if isinstance(exc, RemoteCallError):
            return exc.reason
        if isinstance(exc, TimeoutError):
            return f"the engine app {self.ray.app_name!r} did not answer in time"
        return short_message(str(exc), MAX_REASON_CHARS)

    def _on_health(self, report: dict[str, Any]) -> None:
        """The driver's probe round: availability, voices, features, the replicas it avoids."""
        self.avoided_replicas = frozenset(report.get("avoided", ()))
        self.health_reports += 1
        if "voices" in report:
            self._on_info(report)
        self._set_available(bool(report["available"]), str(report.get("reason", "")), report.get("detail"))

    def _driver_lost(self, reason: str) -> None:
        """The driver process died (the cluster stopped under it): 503 meanwhile, start a new one."""
        self._link = None
        self._set_available(False, f"{reason}; reconnecting")
        if not self._stopping and (self._reconnect_task is None or self._reconnect_task.done()):
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        """New driver processes, `RECONNECT_FIRST_S` apart doubling up to `ray.retry_after_s`, until
        one joins the cluster and a replica answers."""
        lost_at = time.monotonic()
        delay_s = RECONNECT_FIRST_S
        cap_s = max(RECONNECT_FIRST_S, float(self.ray.retry_after_s))
        for attempt in itertools.count(1):
            await asyncio.sleep(delay_s)
            link = self._starting = self._new_link()
            try:
                info = await asyncio.to_thread(link.start)
            except EngineUnavailableError as exc:
                if self._stopping:
                    return
                delay_s = min(cap_s, delay_s * 2.0)
                self._set_available(False, f"{exc}; reconnecting")
                logger.log(
                    logging.WARNING if attempt == 1 else logging.INFO,
                    "remote engine %s: reconnect try %d failed (%s); next in %.2f s",
                    self.ray.app_name,
                    attempt,
                    short_message(str(exc)),
                    delay_s,
                )
                continue
            finally:
                self._starting = None
            if self._stopping:
                link.close()
                return
            self._link = link
            self._on_info(info)
            self.reconnects.append(time.monotonic() - lost_at)
            logger.warning(
                "remote engine %s: reconnected to the Ray cluster at %s after %.1f s (%d tries)",
                self.ray.app_name,
                self.ray.address,
                self.reconnects[-1],
                attempt,
            )
            self._set_available(True)
            return

    def _set_available(self, available: bool, reason: str = "", detail: Any = None) -> None:
        """`reason` is what /readyz and a 503 say (one short line); `detail` goes to the log only."""
        if available != self._available:
            if available:
                logger.info("remote engine %s: available", self.ray.app_name)
            elif detail is not None:
                logger.warning("remote engine %s: %s (%s)", self.ray.app_name, reason, detail)
            else:
                logger.warning("remote engine %s: %s", self.ray.app_name, reason)
        self._available = available
        if reason:
            self._unavailable_reason = short_message(reason, MAX_REASON_CHARS)

    async def _shutdown(self) -> None:
        tasks = [t for t in (self._reconnect_task,) if t is not None]
        for utt in list(self._utts.values()):
            tasks += [t for t in (utt.task, utt.control_task) if t is not None]
            self._finish(utt, Cancelled(utt.utterance_id))
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)  # let them unwind before the loop stops

    def _begin(self, utt: _Utterance) -> None:
        self._send_forgotten()
        self._utts[utt.utterance_id] = utt
        self.stats["utterances"] += 1
        utt.sink.set_space_listener(self._space_freed)
        utt.task = asyncio.get_running_loop().create_task(self._run(utt))

    def _push(self, utterance_id: str, text: str, end: bool = False) -> None:
        utt = self._utts.get(utterance_id)
        if utt is None or utt.finished or utt.input_ended:
            return
        utt.text_chars += len(text)
        if utt.text_chars > self.max_text_chars:
            self._fail(utt, "bad_input", f"text too long: more than {self.max_text_chars} characters")
            return
        utt.note_text(text, self.clock())
        utt.outbox.append(text)
        if end:  # the text and its end leave in one message (`_control`): the replica sees it whole
            self._end(utterance_id)
        utt.wake.set()

    def _end(self, utterance_id: str) -> None:
        utt = self._utts.get(utterance_id)
        if utt is None or utt.finished or utt.input_ended:
            return
        utt.input_ended = True
        if utt.first_text_s is None:
            self._fail(utt, "bad_input", "empty text: nothing to speak")
            return
        utt.wake.set()

    def _cancel(self, utterance_id: str) -> None:
        utt = self._utts.get(utterance_id)
        if utt is not None:
            self._finish(utt, Cancelled(utterance_id))

    async def _run(self, utt: _Utterance) -> None:
        """The utterance's stream: open on a replica, then write its PCM into the sink."""
        text, utt.outbox = "".join(utt.outbox), []
        utt.end_sent = utt.input_ended
        link = self._link
        next_message: asyncio.Future[Any] | None = None
        try:
            if link is None:
                raise DriverLostError(self._unavailable_reason)
            utt.gen = gen = link.stream(
                session=utt.session,
                utterance_id=utt.utterance_id,
                voice=utt.voice,
                text=text,
                end=utt.end_sent,
                max_ahead_ms=self.max_ahead_ms,
                instruct=utt.options.instruct,
                speed=utt.options.speed,
            )
            opened = False
            while not utt.finished and utt.done is None:  # after "done", only the ring may hold it up
                if next_message is None:
                    next_message = asyncio.ensure_future(gen.__anext__())
                timeout_s = self.ray.stall_timeout_s if opened else self.ray.open_timeout_s
                done, _ = await asyncio.wait({next_message}, timeout=timeout_s)
                if not done:
                    if not opened:
                        self._lost(
                            utt, f"no engine replica answered within {timeout_s:g} s (ray.open_timeout_s)"
                        )
                        return
                    if self._owes_audio(utt):
                        self._lost(
                            utt, f"the engine replica sent nothing for {timeout_s:g} s (ray.stall_timeout_s)"
                        )
                        return
                    continue
                message, next_message = next_message.result(), None
                opened = self._on_message(utt, message) or opened
        except StopAsyncIteration:
            self._lost(utt, "the engine replica ended the stream without a result")
        except asyncio.CancelledError:
            raise
        except DriverLostError as exc:  # the cluster stopped under the driver (or it was killed)
            self._lost(utt, CLUSTER_LOST, detail=exc)
        except Exception as exc:  # noqa: BLE001 - a dead or drained replica: this utterance is lost
            self._lost(utt, "the engine replica was lost (it died or was shut down)", detail=exc)
        finally:
            if next_message is not None:
                next_message.cancel()
                next_message.add_done_callback(_retrieve)

    def _on_message(self, utt: _Utterance, message: tuple[Any, ...]) -> bool:
        """Apply one message of the stream; True when it was the `open` header."""
        kind = message[0]
        if kind == "batch":  # several messages that piled up on the replica
            return any([self._on_message(utt, part) for part in message[1]])
        if kind == "pcm":
            pcm = pcm_from_message(message[1])
            rate = int(message[2])
            if len(message) > 4 and message[4] == _HOST:  # same machine: one clock
                self.chunk_delays_ms.append(1000.0 * (time.monotonic() - float(message[3])))
            utt.received_ms += 1000.0 * len(pcm) / rate
            utt.hold(pcm, rate)
            self._flush(utt)
        elif kind == "text":
            utt.hold_mark(str(message[1]))
            self._flush(utt)
        elif kind == "open":
            utt.replica = str(message[1]["replica"])
            self.replica_pids[utt.replica] = int(message[1].get("pid", 0))
            self.replicas[utt.utterance_id] = utt.replica
            while len(self.replicas) > REPLICAS_KEPT:
                self.replicas.popitem(last=False)
            utt.control_task = asyncio.get_running_loop().create_task(self._control(utt))
            return True
        elif kind == "event":
            self._on_terminal(utt, message[1])
        return False

    def _on_terminal(self, utt: _Utterance, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "done":
            utt.done = event
            self._flush(utt)
        elif kind == "failed":
            message = str(event.get("message", ""))
            if len(message) > MAX_MESSAGE_CHARS:
                logger.warning(
                    "utterance %s failed on replica %s: %s", utt.utterance_id, utt.replica, message
                )
            self._fail(utt, str(event.get("code", "synthesis_error")), short_message(message))
        else:  # the replica cancelled it on its own: it is stopping (drained or redeployed)
            self._lost(
                utt, "the engine replica stopped (drained or redeployed) before this utterance finished"
            )

    def _owes_audio(self, utt: _Utterance) -> bool:
        """The replica has all the text it will get and credit to send more: silence is a stall."""
        if not utt.input_ended:
            return False
        return utt.received_ms < self._played_ms(utt) + self.max_ahead_ms - CREDIT_SLACK_MS

    def _played_ms(self, utt: _Utterance) -> float:
        """How much of the utterance left the ring (a lower bound: the ring may hold older audio)."""
        return max(0.0, utt.written_ms - utt.sink.queued_ms)

    def _space_freed(self) -> None:
        """The ring fell below its high-water mark (reader's thread): write what waits."""
        self._post(self._flush_all)

    def _flush_all(self) -> None:
        for utt in list(self._utts.values()):
            if utt.held or utt.done is not None:
                self._flush(utt)

    def _flush(self, utt: _Utterance) -> None:
        """Write held PCM while the ring has room; complete once the replica is done and all is in."""
        if utt.finished:
            return
        if utt.write(lambda event: self._emit(utt, event), self.clock) is Wrote.CLEARED:
            self._finish(utt, Cancelled(utt.utterance_id))  # the ring was cleared (interrupt)
            return
        if utt.done is not None and not utt.held:
            utt.end()
            metrics = {k: float(v) for k, v in (utt.done.get("metrics") or {}).items()}
            self._finish(utt, Done(utt.utterance_id, audio_ms=utt.written_ms, metrics=metrics))

    async def _control(self, utt: _Utterance) -> None:
        """Send text deltas, end of input and playout credit to the utterance's replica, in order."""
        step_ms = max(50.0, self.max_ahead_ms / 4.0)
        while not utt.finished:
            try:
                async with asyncio.timeout(step_ms / 1000.0):
                    await utt.wake.wait()
            except TimeoutError:
                pass
            utt.wake.clear()
            message: dict[str, Any] = {}
            if utt.outbox:
                message["text"], utt.outbox = "".join(utt.outbox), []
            if utt.input_ended and not utt.end_sent:
                message["end"] = utt.end_sent = True
            played = self._played_ms(utt)
            if played - utt.credited_ms >= step_ms or (message and played > utt.credited_ms):
                message["played_ms"] = utt.credited_ms = played
            if not message or utt.finished:
                continue
            try:
                await self._ask(
                    "control",
                    session=utt.session,
                    replica=utt.replica,
                    utterance_id=utt.utterance_id,
                    **message,
                )
            except Exception as exc:  # noqa: BLE001 - the stream notices a lost replica itself
                logger.warning(
                    "utterance %s: control message to replica %s failed: %s",
                    utt.utterance_id,
                    utt.replica,
                    exc,
                )

    def _lost(self, utt: _Utterance, why: str, detail: BaseException | None = None) -> None:
        """Fail `utt` with `engine_lost`: the caller gets `why` (one short line, no pids, addresses or
        actor ids); Ray's own account (`detail`) goes to the log with the utterance and session ids."""
        if utt.finished:
            return
        replica = utt.replica
        if (link := self._link) is not None:
            link.forget(replica, utt.session)  # the driver unpins it and avoids that replica
        self.stats["engine_lost"] += 1
        logger.warning(
            "utterance %s (session %s) lost its engine replica %s: %s",
            utt.utterance_id,
            utt.session,
            replica or "(none chosen yet)",
            why,
        )
        if detail is not None:
            logger.warning(
                "utterance %s: Ray's account of the lost replica %s: %s: %s",
                utt.utterance_id,
                replica or "(none chosen yet)",
                type(detail).__name__,
                detail,
            )
        self._fail(utt, ENGINE_LOST, short_message(why))

    def _fail(self, utt: _Utterance, code: str, message: str) -> None:
        self._finish(utt, Failed(utt.utterance_id, code, message))

    def _finish(self, utt: _Utterance, event: EngineEvent) -> None:
        """End `utt` once: stop its stream (the replica frees it), free it here, send its terminal event."""
        if utt.finished:
            return
        utt.finished = True
        self._utts.pop(utt.utterance_id, None)
        with self._lock:
            self._open.discard(utt.utterance_id)
        current = asyncio.current_task()
        for task in (utt.task, utt.control_task):
            if task is not None and task is not current and not task.done():
                task.cancel()
        if utt.gen is not None and not isinstance(event, Done):
            try:
                utt.gen.cancel()
            except Exception:  # noqa: BLE001 - already finished or torn down
                logger.debug("utterance %s: stream cancel failed", utt.utterance_id, exc_info=True)
        if isinstance(event, Done):
            utt.held.clear()
        else:
            utt.abort()
        self.stats[{Done: "done", Cancelled: "cancelled", Failed: "failed"}[type(event)]] += 1
        self._emit(utt, event)

    def _emit(self, utt: _Utterance, event: EngineEvent) -> None:
        try:
            utt.on_event(event)
        except Exception:
            logger.exception("utterance %s: event callback failed", utt.utterance_id)


def short_message(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """One line of at most `limit` characters (what a caller sees in an error event or a 503)."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3].rstrip() + "..."


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Read a dropped read's outcome (the stream was cancelled under it), so asyncio does not log it."""
    if not future.cancelled():
        future.exception()


def voice_error(error: dict[str, Any]) -> VoiceRTCError:
    """The front-end's exception for a replica's voice-book error answer: same class and code as
    in-process, so the HTTP layer answers the same status."""
    kind, code, message = str(error.get("kind")), str(error.get("code")), str(error.get("message"))
    exc: VoiceRTCError
    if kind == "audio":
        exc = AudioError(code, message, int(error.get("status", 400)))
    elif kind == "unknown_voice":
        exc = UnknownVoiceError(message)
    elif kind == "not_supported":
        exc = NotSupportedError(message)
    else:
        exc = InputError(message)
    exc.code = code
    return exc


def _forget_session(engine: weakref.ref[RemoteEngine], session: str) -> None:
    """A call's sink was collected: drop its pin in the driver (if the engine is still there)."""
    if (alive := engine()) is not None:
        alive.forget_session(session)


def _failed(exc: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(exc)
    return future
