"""Calls beyond localhost: ICE servers handed to clients, and CORS for web apps on other origins.

- `GET /v1/ice-servers` → `{"ice_servers": [RTCIceServer...]}` with fresh TURN credentials per request
  (`voicertc.turn`); `OPTIONS /v1/calls` (what WHIP clients ask before offering) and every `201` of
  `POST /v1/calls` carry the same servers as `Link: <url>; rel="ice-server"` headers, the latter with
  credentials named after the call.
- `[server] cors_origins`: `cors_middleware` answers preflights on /v1 (before auth: a preflight never
  carries the token) and `add_response_headers` marks every /v1 response for an allowed origin,
  exposing `Location`, `Link` and `Retry-After`. Tokens travel in the Authorization header, never in
  cookies, so no response ever says `Access-Control-Allow-Credentials` and `"*"` is safe to allow.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from signaling.auth import principal
from signaling.errors import ApiError
from voicertc.config import Config, ServerConfig
from voicertc.turn import IceServer, ice_servers_for

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
NET_CONFIG = web.AppKey("net_config", Config)

CORS_METHODS = "GET, POST, PATCH, DELETE, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type, If-Match"
CORS_EXPOSED = "Location, Link, Retry-After, X-Ignored-Media"
CORS_MAX_AGE_S = 600
ICE_TRANSPORT_POLICIES = ("relay", "all")

net_routes = web.RouteTableDef()


def _servers(request: web.Request, user_id: str | None = None) -> list[IceServer]:
    """Credentials are named after the call, else after the caller's token digest (or "anon") plus a
    nonce, so every request gets fresh ones."""
    who = user_id or f"{principal(request).owner or 'anon'}-{uuid.uuid4().hex[:8]}"
    return ice_servers_for(request.app[NET_CONFIG], who, time.time())


@net_routes.get("/v1/ice-servers")
async def ice_servers(request: web.Request) -> web.Response:
    """`?ice_transport_policy=relay|all` is echoed as the policy the client should gather with
    (RTCConfiguration.iceTransportPolicy): "relay" forces the TURN relay, for testing it."""
    body: dict[str, object] = {"ice_servers": [server.as_json() for server in _servers(request)]}
    policy = request.query.get("ice_transport_policy")
    if policy is not None:
        if policy not in ICE_TRANSPORT_POLICIES:
            raise ApiError(400, "bad_request", "query parameter 'ice_transport_policy' must be relay or all")
        body["ice_transport_policy"] = policy
    return web.json_response(body, headers={"Cache-Control": "no-store"})


@net_routes.options("/v1/calls")
async def calls_options(request: web.Request) -> web.Response:
    """WHIP: the ICE servers to gather with, before the client sends its offer."""
    response = web.Response(status=204, headers={"Allow": "POST, OPTIONS", "Cache-Control": "no-store"})
    for server in _servers(request):
        for value in server.link_headers():
            response.headers.add("Link", value)
    return response


def cors_allows(config: ServerConfig, origin: str | None) -> str | None:
    """The Access-Control-Allow-Origin value for `origin`, or None (no CORS headers at all)."""
    if not origin or not config.cors_origins:
        return None
    if "*" in config.cors_origins:
        return "*"
    return origin if origin in config.cors_origins else None


def cors_middleware(config: ServerConfig) -> Middleware:
    """Answer CORS preflights on /v1 from allowed origins; anything else goes on as usual (a refused
    origin's preflight then meets the routes and auth like any OPTIONS request, and gets no CORS
    headers, so the browser blocks the real request)."""

    @web.middleware
    async def cors(request: web.Request, handler: Handler) -> web.StreamResponse:
        is_preflight = (
            request.method == "OPTIONS"
            and request.path.startswith("/v1/")
            and "Access-Control-Request-Method" in request.headers
        )
        allowed = cors_allows(config, request.headers.get("Origin"))
        if not is_preflight or allowed is None:
            return await handler(request)
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Origin": allowed,
                "Access-Control-Allow-Methods": CORS_METHODS,
                "Access-Control-Allow-Headers": CORS_HEADERS,
                "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
                "Vary": "Origin",
            },
        )

    return cors


async def add_response_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: CORS on /v1 responses (errors and event streams too) for an allowed origin,
    and the ICE servers as `Link` headers on a created call. Runs before the headers leave."""
    if not request.path.startswith("/v1/"):
        return
    config = request.app[NET_CONFIG]
    if request.method == "POST" and request.path == "/v1/calls" and response.status == 201:
        call_id = response.headers.get("Location", "").rsplit("/", 1)[-1] or None
        for server in _servers(request, call_id):
            for value in server.link_headers():
                response.headers.add("Link", value)
    allowed = cors_allows(config.server, request.headers.get("Origin"))
    if allowed is not None and "Access-Control-Allow-Origin" not in response.headers:
        response.headers["Access-Control-Allow-Origin"] = allowed
        response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSED
        response.headers.add("Vary", "Origin")


def install(app: web.Application, config: Config) -> None:
    """The routes and the response hook (`cors_middleware` goes into the app's middleware list)."""
    app[NET_CONFIG] = config
    app.add_routes(net_routes)
    app.on_response_prepare.append(add_response_headers)
