"""The engine as a Ray Serve deployment: each replica runs today's engine (worker + backend).

`EngineReplica` builds the configured model with the engine builder it is given (the composition root's
`voicertc.assemble.create_local_engine`: Piper, fake, CosyVoice2/3; `engine.workers` threads) and serves
many utterances at once: they meet in its worker, which batches what the backend can batch. Per utterance
the front-end makes one streaming call, `stream(...)`, answered with the messages of
`voicertc.remote.wire`; `control(...)` calls bring text deltas, the end of input and playout credit. When
the front-end cancels the stream (interrupt, hang-up) or goes away, Serve cancels the generator and the
utterance is cancelled in the worker at once.

Flow control: an utterance's `StreamSink` has room only while the audio it sent is less than
`max_ahead_ms` beyond what the front-end reported as played (`played_ms` credit), so a consumer that
does not read never makes a replica produce more than that.

`build_app(config, build_engine)` is the Serve application (`voicertc engine-serve`, or `serve run
voicertc.assemble:app_builder config=config.toml`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np

from voicertc import __version__
from voicertc.audio.decode import AudioError, Clip
from voicertc.config import Config, config_from_dict
from voicertc.engine.protocol import Cancelled, Done, Engine, EngineEvent, Failed, FirstAudio, SpeakOptions
from voicertc.errors import InputError, NotSupportedError, UnknownVoiceError, VoiceRTCError
from voicertc.remote.loopback import bind_replica_servers_to_the_node_address
from voicertc.remote.wire import DEPLOYMENT_NAME, PROTOCOL, ROUTER_CLASS, Message, pcm_message
from voicertc.voice_ids import voice_path

logger = logging.getLogger(__name__)

CONTROL_ROOM = 16  # Serve requests a replica takes beyond its open utterances (text, credit, info)
VOICE_FILES = (
    ".safetensors",
    ".json",
)  # a stored voice (voicertc.backends.cosyvoice.voice.voices), json last
REPORTS_KEPT = 1000  # finished utterances whose report a replica keeps (tests, debugging)


class StreamSink:
    """`AudioSink` of one remote utterance: PCM goes to the stream's queue, bounded by credit.

    Written by the engine thread; `credit`/`close` come from the replica's event loop. `generation`
    stays 0: an interrupt on the front-end cancels the stream instead of clearing a ring here.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, max_ahead_ms: float) -> None:
        self.queue: asyncio.Queue[Message] = asyncio.Queue()
        self.max_ahead_ms = max_ahead_ms
        self.sent_ms = 0.0
        self.played_ms = 0.0
        self.pieces = 0
        self.pieces_at_close: int | None = None
        self._loop = loop
        self._closed = False
        self._listener: Callable[[], None] | None = None
        self._lock = threading.Lock()

    @property
    def generation(self) -> int:
        return 0

    @property
    def queued_ms(self) -> float:
        return max(0.0, self.sent_ms - self.played_ms)

    def has_room(self) -> bool:
        with self._lock:
            return not self._closed and self.sent_ms < self.played_ms + self.max_ahead_ms

    def set_space_listener(self, callback: Callable[[], None] | None) -> None:
        self._listener = callback

    def write(self, pcm: np.ndarray, sample_rate_hz: int, utterance_id: str, generation: int) -> bool:
        with self._lock:
            if self._closed:
                return False
            self.sent_ms += 1000.0 * len(pcm) / sample_rate_hz
            self.pieces += 1
        self._post(pcm_message(pcm, sample_rate_hz))
        return True

    def mark_text(self, utterance_id: str, generation: int, text: str) -> None:
        """The audio sent next speaks `text` (heard_text on the front-end): it travels in order."""
        if text and not self._closed:
            self._post(("text", text))

    def end_utterance(self, utterance_id: str, generation: int) -> None:
        """Nothing to flush here: the `done` event that follows ends the stream."""

    def abort_utterance(self, utterance_id: str, generation: int) -> None:
        """Nothing held here: the terminal event that follows ends the stream."""

    def on_event(self, event: EngineEvent) -> None:
        """The worker's events (engine thread) become the stream's messages."""
        if isinstance(event, FirstAudio):
            self._post(("first_audio", event.ttfa_ms))
        elif isinstance(event, Done):
            self._post(("event", {"type": "done", "audio_ms": event.audio_ms, "metrics": event.metrics}))
        elif isinstance(event, Failed):
            self._post(("event", {"type": "failed", "code": event.code, "message": event.message}))
        elif isinstance(event, Cancelled):
            self._post(("event", {"type": "cancelled"}))

    def credit(self, played_ms: float) -> None:
        """The front-end played this much of the utterance: room for up to `max_ahead_ms` more."""
        with self._lock:
            if played_ms <= self.played_ms:
                return
            self.played_ms = played_ms
        if (listener := self._listener) is not None:
            listener()

    def close(self) -> None:
        """The stream is gone: refuse further writes (the worker then drops the utterance)."""
        with self._lock:
            self._closed = True
            self.pieces_at_close = self.pieces

    def _post(self, message: Message) -> None:
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, message)
        except RuntimeError:
            pass  # the replica's loop is closed: it is shutting down


class EngineReplica:
    """One replica: the configured engine, started in the constructor (model load), plus its streams."""

    def __init__(self, config_data: dict[str, Any], build_engine: Callable[[Config], Engine]) -> None:
        bind_replica_servers_to_the_node_address()  # before Serve starts this replica's gRPC server
        self.config: Config = config_from_dict(config_data)
        self.engine = build_engine(self.config)
        self.engine.start()
        self.replica_id = _replica_id()
        self.model = self.config.engine.model_name
        self._sinks: dict[str, StreamSink] = {}
        self._owners: dict[str, str] = {}  # open utterance id -> the front-end that opened it
        self._reports: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._metrics = _ReplicaMetrics()
        logger.info("engine replica %s ready (model %s)", self.replica_id, self.model)

    async def info(self, front_end: str = "", **_routing: Any) -> dict[str, Any]:
        """What the front-end checks at connect (versions, voices) and health probes; `others_open`
        is the utterances open here for front-ends other than `front_end` (the router's load)."""
        others = sum(1 for owner in self._owners.values() if owner != front_end)
        return {
            "version": __version__,
            "protocol": PROTOCOL,
            "model": self.model,
            "voices": self.engine.voices(),
            "replica": self.replica_id,
            "open_utterances": len(self._sinks),
            "others_open": others,
            "features": sorted(f for f in ("instruct", "speed") if self._supports(f)),
        }

    async def voices(self, **_routing: Any) -> list[dict[str, Any]]:
        """This replica's voice book (built-in and stored voices, with what is known about them)."""
        return [dict(info) for info in await asyncio.wrap_future(self.engine.list_voices())]

    def _supports(self, feature: str) -> bool:
        return self.engine.supports(feature)

    # --- voices: registered once, on every replica --------------------------------------------------

    async def register_voice(
        self,
        *,
        samples: bytes,
        sample_rate_hz: int,
        transcript: str | None,
        voice_id: str | None,
        name: str,
        **_routing: Any,
    ) -> dict[str, Any]:
        """Compute a voice from a clip (float32 samples) here, store it in `[engine] voices_dir`;
        answers {"info", "files", "replica"} (the stored files, for the other replicas) or {"error"}."""
        clip = Clip(np.frombuffer(samples, dtype="<f4").copy(), int(sample_rate_hz))
        if not self.config.engine.voices_dir:
            return _error_answer(NotSupportedError(NO_VOICES_DIR))
        try:
            info = await asyncio.wrap_future(self.engine.register_voice(clip, transcript, voice_id, name))
        except VoiceRTCError as exc:
            return _error_answer(exc)
        files = await asyncio.to_thread(_read_voice_files, self._voices_dir(), str(info["id"]))
        return {"info": dict(info), "files": files, "replica": self.replica_id}

    async def load_voice(self, *, voice_id: str, files: dict[str, bytes], **_routing: Any) -> dict[str, Any]:
        """A voice another replica registered: its files into this replica's voices_dir (unless
        they are there: a shared directory), then into the voice book; answers {"info"} or {"error"}."""
        if not self.config.engine.voices_dir:
            return _error_answer(NotSupportedError(NO_VOICES_DIR))
        try:
            await asyncio.to_thread(_write_voice_files, self._voices_dir(), voice_id, files)
            info = await asyncio.wrap_future(self.engine.submit_command(lambda b: _load_stored(b, voice_id)))
        except (VoiceRTCError, OSError) as exc:
            return _error_answer(exc)
        return {"info": info}

    async def delete_voice(self, *, voice_id: str, **_routing: Any) -> dict[str, Any]:
        """Drop the voice here (and its files); answers {} or {"error"} (unknown_voice, read-only)."""
        try:
            await asyncio.wrap_future(self.engine.delete_voice(voice_id))
        except VoiceRTCError as exc:
            return _error_answer(exc)
        return {}

    def _voices_dir(self) -> Path:
        return Path(self.config.engine.voices_dir)

    async def stream(
        self,
        *,
        session: str,
        utterance_id: str,
        voice: str | None,
        text: str = "",
        end: bool = False,
        max_ahead_ms: float = 2000.0,
        instruct: str = "",
        speed: float = 1.0,
        front_end: str = "",
    ) -> AsyncIterator[Message]:
        """One utterance: `open`, PCM pieces as they are made (within credit), one terminal event."""
        sink = StreamSink(asyncio.get_running_loop(), max_ahead_ms)
        options = SpeakOptions(instruct=instruct, speed=speed)
        try:
            if options:
                self.engine.open_utterance(voice, sink, sink.on_event, utterance_id, options)
            else:
                self.engine.open_utterance(voice, sink, sink.on_event, utterance_id)
        except VoiceRTCError as exc:
            yield ("event", {"type": "failed", "code": exc.code, "message": str(exc)})
            return
        self._sinks[utterance_id] = sink
        self._owners[utterance_id] = front_end
        self._metrics.opened(len(self._sinks))
        logger.debug(
            "utterance %s of session %s opened on replica %s", utterance_id, session, self.replica_id
        )
        finished = False
        try:
            yield ("open", self._header())
            if text:  # with its end in one command: a whole text is spoken whole
                self.engine.push_text(utterance_id, text, end)
            elif end:
                self.engine.end_input(utterance_id)
            while not finished:
                batch = [await sink.queue.get()]
                while not sink.queue.empty():  # what piled up meanwhile goes as one message
                    batch.append(sink.queue.get_nowait())
                out: list[Message] = []
                for message in batch:
                    if message[0] == "first_audio":
                        self._metrics.first_audio(float(message[1]))
                        continue
                    out.append(message)
                    if message[0] == "event":
                        finished = True
                        break
                if len(out) == 1:
                    yield out[0]
                elif out:
                    yield ("batch", out)
        finally:
            sink.close()
            self._sinks.pop(utterance_id, None)
            self._owners.pop(utterance_id, None)
            self._metrics.closed(len(self._sinks))
            if not finished:
                self.engine.cancel(utterance_id)  # the front-end cancelled or went away: free it now
            self._report(utterance_id, sink, cancelled=not finished)

    def _header(self) -> dict[str, Any]:
        return {"replica": self.replica_id, "pid": os.getpid(), "version": __version__, "protocol": PROTOCOL}

    async def control(
        self,
        *,
        session: str,
        replica: str,
        utterance_id: str,
        text: str = "",
        end: bool = False,
        played_ms: float | None = None,
    ) -> bool:
        """Text deltas, end of input and credit for an open utterance; False if it is not open here."""
        sink = self._sinks.get(utterance_id)
        if sink is None:
            return False
        if text:
            self.engine.push_text(utterance_id, text, end)
        elif end:
            self.engine.end_input(utterance_id)
        if played_ms is not None:
            sink.credit(played_ms)
        return True

    async def report(self, *, replica: str, utterance_id: str) -> dict[str, Any] | None:
        """How a finished utterance went here: pieces sent, and pieces made after its stream closed."""
        entry = self._reports.get(utterance_id)
        if entry is None:
            return None
        sink: StreamSink = entry["sink"]
        at_close = sink.pieces if sink.pieces_at_close is None else sink.pieces_at_close
        return {
            "replica": self.replica_id,
            "cancelled": entry["cancelled"],
            "pieces": sink.pieces,
            "pieces_after_close": sink.pieces - at_close,
            "sent_ms": round(sink.sent_ms, 1),
        }

    def __del__(self) -> None:
        try:
            self.engine.stop()
        except Exception:  # noqa: BLE001 - best effort at replica shutdown
            logger.debug("engine stop at replica shutdown failed", exc_info=True)

    def _report(self, utterance_id: str, sink: StreamSink, cancelled: bool) -> None:
        # the sink itself: a write already in flight at close still counts when `report` reads it
        self._reports[utterance_id] = {"sink": sink, "cancelled": cancelled}
        while len(self._reports) > REPORTS_KEPT:
            self._reports.popitem(last=False)


NO_VOICES_DIR = (
    "registering voices on the Ray backend needs [engine] voices_dir in the engine app's config "
    "(shared by its replicas, or one per node: voicertc copies each voice there)"
)


def _error_answer(exc: BaseException) -> dict[str, Any]:
    """A voice-book error as data (Ray would wrap the exception): the front-end raises its like."""
    kind = (
        "audio"
        if isinstance(exc, AudioError)
        else "unknown_voice"
        if isinstance(exc, UnknownVoiceError)
        else "not_supported"
        if isinstance(exc, NotSupportedError)
        else "input"
        if isinstance(exc, InputError)
        else "other"
    )
    code = getattr(exc, "code", "voice_error")
    return {"error": {"kind": kind, "code": code, "message": str(exc), "status": getattr(exc, "status", 400)}}


def _read_voice_files(directory: Path, voice_id: str) -> dict[str, bytes]:
    return {suffix: voice_path(directory, voice_id, suffix).read_bytes() for suffix in VOICE_FILES}


def _write_voice_files(directory: Path, voice_id: str, files: dict[str, bytes]) -> None:
    """Each file atomically (the json last: a half-copied voice is never loaded at a start)."""
    directory.mkdir(parents=True, exist_ok=True)
    for suffix in VOICE_FILES:
        path = voice_path(directory, voice_id, suffix)
        data = files[suffix]
        if path.is_file() and path.read_bytes() == data:
            continue
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)


def _load_stored(backend: Any, voice_id: str) -> dict[str, Any]:
    """Engine thread: the stored voice into the backend's voice book (kept when already there)."""
    book = getattr(backend, "book", None)
    store = getattr(book, "store", None)
    if book is None or store is None:
        raise NotSupportedError(f"the {backend.name} engine does not register voices")
    if voice_id not in book.ids():
        book.add(store.load(backend.model, voice_id), persist=False)
    return dict(book.get(voice_id).describe())


class _ReplicaMetrics:
    """Per-replica metrics on Ray's Prometheus endpoint (Serve tags them with the replica)."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self.utterances = metrics.Counter("voicertc_utterances_total", description="utterances opened")
        self.open = metrics.Gauge("voicertc_open_utterances", description="utterances open (one batch)")
        self.batch = metrics.Histogram(
            "voicertc_batch_size",
            description="open utterances when one opens (what the worker can batch)",
            boundaries=[1, 2, 4, 8, 16, 32, 64],
        )
        self.ttfa = metrics.Histogram(
            "voicertc_ttfa_ms",
            description="replica time to first audio (ms)",
            boundaries=[25, 50, 100, 200, 400, 800, 1600, 3200],
        )

    def opened(self, open_now: int) -> None:
        self.utterances.inc()
        self.open.set(open_now)
        self.batch.observe(open_now)

    def closed(self, open_now: int) -> None:
        self.open.set(open_now)

    def first_audio(self, ttfa_ms: float) -> None:
        self.ttfa.observe(ttfa_ms)


def _replica_id() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # noqa: BLE001 - outside Serve (unit use): a local name
        return "local"


def config_data(config: Config) -> dict[str, Any]:
    """The config as plain TOML-shaped data (what a replica gets; tuples as lists)."""
    return {
        name: {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(section).items()}
        for name, section in ((f.name, getattr(config, f.name)) for f in dataclasses.fields(config))
    }


def deployment_options(config: Config) -> dict[str, Any]:
    """Serve options from `[ray]`: replicas or autoscaling, CPUs/GPUs per replica, the router."""
    from ray.serve.config import RequestRouterConfig

    ray = config.ray
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        # open streams are capped by the engine (limits.max_utterances); control calls need room beside them
        "max_ongoing_requests": max(ray.max_ongoing_requests, config.limits.max_utterances + CONTROL_ROOM),
        "ray_actor_options": {"num_cpus": ray.num_cpus, "num_gpus": ray.num_gpus},
        "request_router_config": RequestRouterConfig(request_router_class=ROUTER_CLASS),  # type: ignore[arg-type]
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 10.0,
        "graceful_shutdown_timeout_s": 5.0,
    }
    if ray.autoscale:
        options["autoscaling_config"] = {
            "min_replicas": ray.min_replicas,
            "max_replicas": ray.max_replicas,
            "target_ongoing_requests": ray.target_ongoing_requests,
        }
    else:
        options["num_replicas"] = ray.num_replicas
    return options


def build_app(config: Config, build_engine: Callable[[Config], Engine], **overrides: Any) -> Any:
    """The engine app for `serve.run`: replicas build their engine with `build_engine` (a module-level
    function, pickled by reference); `overrides` replace deployment options, e.g. num_replicas."""
    from ray import serve

    local = dataclasses.replace(
        config, engine=dataclasses.replace(config.engine, backend=config.engine.model_name, model="")
    )
    options = {**deployment_options(config), **overrides}
    deployment = serve.deployment(EngineReplica)  # a class: a Deployment (the stubs pick the decorator)
    return deployment.options(**options).bind(config_data(local), build_engine)  # type: ignore[attr-defined]
