"""RemoteEngine: the `voicertc.engine.protocol.Engine` seam over the Ray Serve engine deployment.

The front-end's transport (calls, speech queues, rings) is unchanged: it opens utterances, pushes
text and cancels, and PCM arrives in the same `RingSink`. Behind the seam, each utterance is one
streaming call to a replica (`EngineReplica.stream`), pinned per call by `SessionAffinityRouter`.

Threads: public methods are safe from any thread; they hop onto the client's own event loop thread
("voicertc-remote"), which plays the engine thread's role: it owns the deployment handle, writes the
sinks (resampling there, off the server's loop) and sends the engine events.

Faults: a replica that dies or drains mid-utterance, or stays silent for `ray.stall_timeout_s` while it
has text and credit, fails the utterance with code `engine_lost` (never silence), and the call's next
utterance goes to another replica. A health probe every `ray.health_interval_s` marks the engine
unavailable while the app cannot be reached: opening an utterance then raises
`EngineUnavailableError` (HTTP 503 + Retry-After); calls stay up.

Flow control: the client reports how much of an utterance has played out of the ring (`played_ms`),
and the replica stays at most `engine.max_ahead_ms` ahead of it.
"""

from __future__ import annotations

import asyncio
import logging
import os
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

from voicertc import __version__
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
from voicertc.errors import EngineUnavailableError, InputError, NotSupportedError, UnknownVoiceError
from voicertc.remote import affinity
from voicertc.remote.wire import PROTOCOL, check_versions, pcm_from_message

if TYPE_CHECKING:
    from voicertc.audio.decode import Clip
    from voicertc.engine.batch_stats import BatchStats
    from voicertc.engine.step_stats import StepStats

T = TypeVar("T")

logger = logging.getLogger(__name__)

ENGINE_LOST = "engine_lost"
MAX_MESSAGE_CHARS = 200  # caller-facing error messages: one short, stable line (details go to the log)
REGISTER_NOT_SUPPORTED = (
    'registering voices through a front-end with engine.backend = "ray" is not supported yet: save the '
    "voice into the replicas' [engine] voices_dir (register it on an in-process server using that "
    "directory) and redeploy; replicas load the voices there when they start"
)
DELETE_NOT_SUPPORTED = (
    'deleting voices through a front-end with engine.backend = "ray" is not supported yet: remove it from '
    "the replicas' [engine] voices_dir and redeploy"
)
MAX_REASON_CHARS = 300  # /readyz and 503 reasons: may name the app, the address and the command to run
REPLICAS_KEPT = 10_000  # utterance id -> replica, for operators and tests
CREDIT_SLACK_MS = 100.0
DELAYS_KEPT = 100_000  # recent per-chunk hop delays (replica on this machine), for bench.remote_load
_HOST = socket.gethostname()  # a replica within this of its credit limit is waiting for credit, not stalled


class VersionSkewError(EngineUnavailableError):
    """The engine app runs another voicertc version than this front-end (refused at connect)."""

    code = "version_skew"


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
    counted_on: str | None = None  # the replica whose load this utterance counts in (until it ends)
    task: asyncio.Task[None] | None = None
    control_task: asyncio.Task[None] | None = None
    gen: Any = None
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
        self._handle: Any = None
        self._stream_handle: Any = None
        self._health: asyncio.Task[None] | None = None
        self._owns_ray = False

    # --- lifecycle (blocking; off the server's loop) -------------------------------------------------

    def start(self) -> None:
        """Connect to the cluster and the engine app, check versions; raises EngineUnavailableError
        naming the address (or VersionSkewError naming both versions) when that fails."""
        if self._thread is not None:
            return
        self._owns_ray = connect_ray(self.ray)
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="voicertc-remote", daemon=True)
        self._loop = loop
        self._thread.start()
        try:
            info = self._call(self._connect(), timeout_s=self.ray.connect_timeout_s + 5.0)
        except BaseException:
            self.stop()
            raise
        self._voices = list(info.get("voices", []))
        self._features = frozenset(info.get("features", ()))
        self._set_available(True)
        self._health = self._call(self._start_health(), timeout_s=5.0)
        logger.info(
            "remote engine: app %s at %s (model %s, voices %s)",
            self.ray.app_name,
            self.ray.address,
            info.get("model"),
            ", ".join(self._voices),
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Cancel every open utterance and close the client loop (the replicas stay up)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._available = False
        self._unavailable_reason = "the remote engine is stopped"
        try:
            self._call(self._shutdown(), timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            logger.exception("remote engine: shutdown failed")
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        loop.close()
        self._loop = self._thread = None
        self._handle = None
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False

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
        return _failed(NotSupportedError(REGISTER_NOT_SUPPORTED))

    def delete_voice(self, voice_id: str) -> Future[None]:
        if voice_id in self._voices:
            return _failed(NotSupportedError(DELETE_NOT_SUPPORTED))
        return _failed(UnknownVoiceError(f"unknown voice {voice_id!r}"))

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

    def push_text(self, utterance_id: str, text: str) -> None:
        self._post(self._push, utterance_id, text)

    def end_input(self, utterance_id: str) -> None:
        self._post(self._end, utterance_id)

    def cancel(self, utterance_id: str) -> None:
        with self._lock:
            self._open.discard(utterance_id)
        self._post(self._cancel, utterance_id)

    def say(self, voice: str | None, sink: AudioSink, on_event: EventCallback, text: str) -> str:
        uid = self.open_utterance(voice, sink, on_event)
        self.push_text(uid, text)
        self.end_input(uid)
        return uid

    def report(self, utterance_id: str, timeout_s: float = 10.0) -> dict[str, Any] | None:
        """The replica's account of a finished utterance (pieces made, pieces made after cancel)."""
        replica = self.replicas.get(utterance_id)
        if replica is None:
            return None
        return self._call(self._report(replica, utterance_id), timeout_s=timeout_s)

    # --- the client loop -----------------------------------------------------------------------------

    def _session_for(self, sink: AudioSink) -> str:
        """One session key per sink (one call's ring), under `_lock`; its pin goes with the sink."""
        session = self._sessions.get(sink)
        if session is None:
            session = uuid.uuid4().hex
            self._sessions[sink] = session
            weakref.finalize(sink, affinity.forget_session, session)
        return session

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
            raise VersionSkewError(skew)
        return info

    async def _ask(self, method: str, **kwargs: Any) -> Any:
        """One call to a replica method within `ray.control_timeout_s`. A call that fails or times
        out is cancelled in Serve too: one routed to a replica that is gone would otherwise wait in
        the router for it forever."""
        response = getattr(self._handle, method).remote(**kwargs)
        try:
            async with asyncio.timeout(self.ray.control_timeout_s):
                return await response
        except BaseException:
            response.cancel()
            raise

    async def _list_voices(self) -> list[VoiceInfo]:
        try:
            infos: list[VoiceInfo] = await self._ask("voices")
        except Exception as exc:  # noqa: BLE001 - Ray raises many types; all mean "not answering"
            reason = self._unavailable_because(exc)
            logger.warning("remote engine %s: listing voices failed: %s (%r)", self.ray.app_name, reason, exc)
            raise EngineUnavailableError(reason, self.ray.retry_after_s) from None
        self._voices = [str(info["id"]) for info in infos]
        return infos

    async def _start_health(self) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self) -> None:
        """Probe every replica (exact routing) each `health_interval_s`: a replica that does not answer
        is avoided, one that answers again takes new calls again, and their reported loads feed the
        router. The engine is unavailable only while no replica answers."""
        while True:
            await asyncio.sleep(self.ray.health_interval_s)
            await self._probe_replicas()

    async def _probe_replicas(self) -> None:
        replicas = affinity.known_replicas(self.ray.app_name)
        targets: list[str | None] = list(replicas) or [None]  # None: any replica (none known yet)
        results = await asyncio.gather(*(self._probe(rid) for rid in targets), return_exceptions=True)
        answers = [r for r in results if isinstance(r, dict)]
        if not answers:
            failure = next((r for r in results if isinstance(r, BaseException)), None)
            if failure is not None:
                self._set_available(False, self._unavailable_because(failure), detail=failure)
            return
        info = answers[0]
        if skew := check_versions(info, self.client_version, PROTOCOL):
            self._set_available(False, skew)
            return
        self._voices = list(info.get("voices", self._voices))
        self._set_available(True)

    async def _probe(self, replica: str | None) -> dict[str, Any]:
        """One replica's info (or any replica's, for None); marks that replica healthy or avoided."""
        routing = {"replica": replica} if replica is not None else {}
        try:
            info: dict[str, Any] = await self._ask("info", front_end=affinity.FRONT_END, **routing)
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

    def _set_available(self, available: bool, reason: str = "", detail: BaseException | None = None) -> None:
        """`reason` is what /readyz and a 503 say (one short line); `detail` goes to the log only."""
        if available != self._available:
            if available:
                logger.info("remote engine %s: available", self.ray.app_name)
            elif detail is not None:
                logger.warning(
                    "remote engine %s: %s (%s: %s)", self.ray.app_name, reason, type(detail).__name__, detail
                )
            else:
                logger.warning("remote engine %s: %s", self.ray.app_name, reason)
        self._available = available
        if reason:
            self._unavailable_reason = short_message(reason, MAX_REASON_CHARS)

    def _unavailable_because(self, exc: BaseException) -> str:
        """The caller-facing reason the app does not answer, from Ray's exception (no Ray internals)."""
        app = self.ray.app_name
        if isinstance(exc, TimeoutError):
            return f"the engine app {app!r} did not answer within {self.ray.control_timeout_s:g} s"
        if _app_missing(exc):
            return (
                f"the engine app {app!r} is not deployed on the Ray cluster at {self.ray.address!r}; "
                f"deploy it: voicertc engine-serve --app-name {app} --detach"
            )
        return f"the engine app {app!r} is unavailable ({type(exc).__name__}); details in the log"

    async def _shutdown(self) -> None:
        tasks = [t for t in (self._health,) if t is not None]
        for utt in list(self._utts.values()):
            tasks += [t for t in (utt.task, utt.control_task) if t is not None]
            self._finish(utt, Cancelled(utt.utterance_id))
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)  # let them unwind before the loop stops

    async def _report(self, replica: str, utterance_id: str) -> dict[str, Any] | None:
        result: dict[str, Any] | None = await self._handle.report.remote(
            replica=replica, utterance_id=utterance_id
        )
        return result

    def _begin(self, utt: _Utterance) -> None:
        self._utts[utt.utterance_id] = utt
        self.stats["utterances"] += 1
        utt.sink.set_space_listener(self._space_freed)
        utt.task = asyncio.get_running_loop().create_task(self._run(utt))

    def _push(self, utterance_id: str, text: str) -> None:
        utt = self._utts.get(utterance_id)
        if utt is None or utt.finished or utt.input_ended:
            return
        utt.text_chars += len(text)
        if utt.text_chars > self.max_text_chars:
            self._fail(utt, "bad_input", f"text too long: more than {self.max_text_chars} characters")
            return
        utt.note_text(text, self.clock())
        utt.outbox.append(text)
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
        handle = self._stream_handle
        next_message: asyncio.Future[Any] | None = None
        try:
            utt.gen = handle.stream.remote(
                session=utt.session,
                utterance_id=utt.utterance_id,
                voice=utt.voice,
                text=text,
                end=utt.end_sent,
                max_ahead_ms=self.max_ahead_ms,
                instruct=utt.options.instruct,
                speed=utt.options.speed,
                front_end=affinity.FRONT_END,
            )
            opened = False
            while not utt.finished and utt.done is None:  # after "done", only the ring may hold it up
                if next_message is None:
                    next_message = asyncio.ensure_future(utt.gen.__anext__())
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
            if utt.counted_on is None:
                utt.counted_on = utt.replica
                affinity.utterance_opened(utt.replica)
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
        replica = self._replica_of(utt)
        if replica is not None:
            affinity.forget_replica(replica)
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

    def _replica_of(self, utt: _Utterance) -> str | None:
        """The replica serving `utt`: from its `open` header, else the one the router pinned it to."""
        return utt.replica or affinity.pinned_replica(utt.session)

    def _fail(self, utt: _Utterance, code: str, message: str) -> None:
        self._finish(utt, Failed(utt.utterance_id, code, message))

    def _finish(self, utt: _Utterance, event: EngineEvent) -> None:
        """End `utt` once: stop its stream (the replica frees it), free it here, send its terminal event."""
        if utt.finished:
            return
        utt.finished = True
        if utt.counted_on is not None:
            affinity.utterance_closed(utt.counted_on)  # ended: it stops counting at once
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


def _app_missing(exc: BaseException) -> bool:
    """Ray says the app or its deployment is gone (deleted, never deployed); its message is terse."""
    text = str(exc)
    return (
        type(exc).__name__ in ("DeploymentUnavailableError",)
        or "does not exist" in text
        or (text.startswith("Deployment(name="))
    )


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Read a dropped read's outcome (the stream was cancelled under it), so asyncio does not log it."""
    if not future.cancelled():
        future.exception()


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


def _failed(exc: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(exc)
    return future
