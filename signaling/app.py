"""The aiohttp application: /v1 API, /healthz, /readyz, /metrics, /openapi.json and the web page at /.

`create_app(config)` builds the engine the config names (or takes one), starts it with the app (or,
with `[engine] load_in_background`, behind /readyz while the server already listens) and stops it on
cleanup after every call is closed.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from signaling import net
from signaling.audio_ws import audio_routes
from signaling.auth import auth_middleware, principal
from signaling.drain import DRAIN, Drain, drain_middleware
from signaling.drain import RETRY_AFTER_S as DRAIN_RETRY_AFTER_S
from signaling.edges import CLIENT_CLOSED, body_guard
from signaling.errors import ApiError, error_response
from signaling.metrics import Metrics
from signaling.openapi import openapi_spec
from signaling.openapi_facts import EngineFacts
from signaling.registry import CallRegistry
from signaling.routes import REGISTRY, routes
from signaling.speech_api import speech_routes
from signaling.tts_ws import tts_ws_routes
from signaling.voice_admin import VoiceAdmin
from signaling.voice_owners import VoiceOwners
from signaling.voice_routes import VOICE_OWNERS, VOICES, voice_routes
from voicertc.assemble import create_engine
from voicertc.config import Config
from voicertc.engine.protocol import Engine
from voicertc.errors import ConfigError, EngineStoppedError, EngineUnavailableError
from voicertc.listen.models import load_listen_models
from voicertc.webrtc.loopback import patch_aioice_loopback
from voicertc.webrtc.ports import patch_aioice_port_range
from voicertc.webrtc.speech import engine_features

logger = logging.getLogger(__name__)

CONFIG = web.AppKey("config", Config)
ENGINE = web.AppKey("engine", Engine)
ENGINE_START = web.AppKey("engine_start", asyncio.Future)
METRICS = web.AppKey("metrics", Metrics)
WEB_DIR = Path(__file__).resolve().parents[1] / "web"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(config: Config, engine: Engine | None = None) -> web.Application:
    """The whole server as an aiohttp app; pass `engine` to share one (it is started but not stopped)."""
    static_dir = Path(config.server.static_dir) if config.server.static_dir else WEB_DIR
    if not static_dir.is_dir():
        raise ConfigError(f"server.static_dir: {str(static_dir)!r} is not a folder")
    app = web.Application(
        middlewares=[
            net.cors_middleware(config.server),  # preflights first: they carry no token
            _errors,
            body_guard(config.server.body_timeout_s),
            auth_middleware(config.auth),
            drain_middleware(),
        ],
        client_max_size=4 * 1024 * 1024,
        handler_args={"logger": ProtocolLogger(logging.getLogger("aiohttp.server"))},
    )
    owns_engine = engine is None
    engine = engine if engine is not None else create_engine(config)
    metrics = Metrics()
    app[CONFIG] = config
    app[ENGINE] = engine
    app[METRICS] = metrics
    app[REGISTRY] = CallRegistry(engine, config, metrics)
    app[VOICES] = VoiceAdmin(engine, config.limits)
    app[DRAIN] = Drain(app[REGISTRY], config.server.drain_timeout_s)
    net.install(app, config)  # GET /v1/ice-servers, OPTIONS /v1/calls, Link and CORS headers
    app[VOICE_OWNERS] = app[REGISTRY].voice_owners = VoiceOwners(config.limits, config.engine.voices_dir)
    app.add_routes(routes)
    app.add_routes(voice_routes)
    app.add_routes(audio_routes)  # GET /v1/calls/{id}/audio (WebSocket of the caller's mic)
    app.add_routes(speech_routes)  # POST /v1/audio/speech (OpenAI-compatible)
    app.add_routes(tts_ws_routes)  # GET /v1/tts/stream (WebSocket: text deltas in, audio out)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_get("/", _index(static_dir / "index.html"))
    app.router.add_static("/static/", static_dir)

    restore_ice: list[Callable[[], None]] = []

    async def start_engine(_app: web.Application) -> None:
        if config.webrtc.loopback_only:
            restore_ice.append(patch_aioice_loopback())  # offer 127.0.0.1 (aioice skips it by default)
        if config.webrtc.udp_port_min:
            ports = (config.webrtc.udp_port_min, config.webrtc.udp_port_max)
            restore_ice.append(patch_aioice_port_range(*ports))  # host candidates inside the range
        # [listen] models first: one that does not load stops the start (ConfigError naming the package)
        await asyncio.get_running_loop().run_in_executor(None, load_listen_models, config.listen)
        loading = asyncio.get_running_loop().run_in_executor(None, engine.start)  # loads models off the loop
        app[ENGINE_START] = loading
        if not config.engine.load_in_background:
            await loading
            return
        loading.add_done_callback(_log_load_failure)

    async def close_calls(_app: web.Application) -> None:
        await app[REGISTRY].close_all()

    async def stop_engine(_app: web.Application) -> None:
        loading = app.get(ENGINE_START)
        if loading is not None and not loading.done():
            await asyncio.wait([loading])  # a background load finishes before the engine stops
        if owns_engine:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        for restore in restore_ice:
            restore()

    app.on_startup.append(start_engine)
    app.on_shutdown.append(close_calls)
    app.on_cleanup.append(stop_engine)
    return app


class ProtocolLogger(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's connection logger, minus the traceback for a request its parser refused (a NUL byte
    in a header, an overlong line...): aiohttp already answered it 400, so one INFO line says enough."""

    def exception(self, msg: object, *args: object, exc_info: object = True, **kwargs: object) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError):
            self.info("malformed HTTP request refused (%s): %s", exc.code, str(exc.message).splitlines()[0])
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)  # type: ignore[arg-type]


def http_url(host: str, port: int) -> str:
    """The base URL of a listening address (IPv6 hosts in brackets; a wildcard stays as bound)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def listen_error(config: Config, exc: OSError) -> ConfigError:
    """A clear start error for a socket that cannot be bound (port in use, bad address)."""
    where = http_url(config.server.host, config.server.port)
    if exc.errno == errno.EADDRINUSE:
        return ConfigError(f"server.port: {where} is already in use (pick another port, or 0 for any)")
    return ConfigError(f"server.host/server.port: cannot listen on {where}: {exc.strerror or exc}")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as JSON `{"error": {"code", "message"}}` and is counted in /metrics."""
    response = await _error_json(request, handler)
    if response.status >= 400 and response.status != CLIENT_CLOSED:  # a client that left is no error
        request.app[METRICS].http_error(response.status)
    return response


async def _error_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        if exc.status >= 500:
            logger.warning("%s %s -> %d %s", request.method, request.path, exc.status, exc.message)
        return error_response(exc.status, exc.code, exc.message, exc.headers)
    except EngineUnavailableError as exc:  # a remote engine out of reach: say when to ask again
        return error_response(503, exc.code, str(exc), {"Retry-After": str(exc.retry_after_s)})
    except EngineStoppedError as exc:
        return error_response(503, exc.code, str(exc))
    except HttpProcessingError as exc:  # a body aiohttp could not parse (multipart framing, headers)
        message = str(exc.message).splitlines()[0] if exc.message else "malformed request"
        return error_response(400, "bad_request", f"malformed request: {message}")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(
            exc.status, "http_error"
        )
        kept = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
        return error_response(exc.status, code, exc.reason or exc.text or code, kept)
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("%s %s failed", request.method, request.path)
        return error_response(500, "internal_error", "internal server error (see the server log)")


async def _healthz(request: web.Request) -> web.Response:
    """Liveness for anyone; the engine, its voices and the caller's open calls only with a valid token
    (or when auth is off)."""
    engine = request.app[ENGINE]
    running = engine.running
    body: dict[str, object] = {"status": "ok" if running else "engine_stopped"}
    caller = principal(request)
    if caller.sees_details:
        body["engine"] = request.app[CONFIG].engine.backend
        body["voices"] = request.app[REGISTRY].voices_for(caller)
        body["active_calls"] = request.app[REGISTRY].count_for(caller)
    return web.json_response(body, status=200 if running else 503)


def _log_load_failure(loading: asyncio.Future) -> None:
    if not loading.cancelled() and loading.exception() is not None:
        logger.error("engine failed to load: %s (GET /readyz reports it)", loading.exception())


async def _readyz(request: web.Request) -> web.Response:
    """Readiness: 200 once the engine has loaded and warmed up and accepts utterances; 503 + reason before
    (and after it stopped). `/healthz` is liveness."""
    engine = request.app[ENGINE]
    ready = engine.ready
    if request.app[DRAIN].draining:
        return web.json_response(
            {"status": "not_ready", "reason": "draining", "engine": request.app[CONFIG].engine.backend},
            status=503,
            headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)},
        )
    if ready:
        return web.json_response({"status": "ready", "engine": request.app[CONFIG].engine.backend})
    reason = engine.not_ready_reason or "engine not ready"
    loading = request.app.get(ENGINE_START)
    if loading is not None and not loading.done() and not engine.running:
        reason = "engine is loading and warming up"  # its thread is not started yet
    return web.json_response(
        {"status": "not_ready", "reason": reason, "engine": request.app[CONFIG].engine.backend},
        status=503,
        headers={"Retry-After": "1"},
    )


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[METRICS].render(), content_type="text/plain", charset="utf-8")


async def _openapi(request: web.Request) -> web.Response:
    """Generated per request: the voices this caller may use and the options the engine honours."""
    voices = request.app[REGISTRY].voices_for(principal(request))
    facts = EngineFacts(voices=tuple(voices) or None, features=tuple(engine_features(request.app[ENGINE])))
    return web.json_response(openapi_spec(request.app[CONFIG], facts))


def _index(path: Path) -> Handler:
    async def index(_request: web.Request) -> web.StreamResponse:
        # checked here: FileResponse would 404 in plain text, after the error middleware is done
        if not await asyncio.to_thread(path.is_file):
            raise ApiError(404, "not_found", f"no web page: {path.name} is missing from server.static_dir")
        return web.FileResponse(path)

    return index
