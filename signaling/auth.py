"""Bearer tokens: who a request is, which calls it may touch, and who may read /metrics.

A call belongs to the token that created it; another token gets 404 for it (no existence oracle).
`[auth] admin_tokens` see every call. Tokens are compared in constant time and never stored on a call
or logged: a call keeps only a short digest of its owner's token.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Middleware

from signaling.errors import error_response
from voicertc.config import AuthConfig

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Principal:
    """The caller: `owner` is a digest of its token (None without auth); `admin` sees every call."""

    owner: str | None
    admin: bool
    authenticated: bool

    def may_use(self, call_owner: str | None) -> bool:
        return self.admin or (self.owner is not None and call_owner == self.owner)

    @property
    def sees_details(self) -> bool:
        """/healthz details: with a valid token, or when auth is off."""
        return self.admin or self.authenticated


ANONYMOUS = Principal(owner=None, admin=True, authenticated=False)  # auth is off: everything is open
NOBODY = Principal(owner=None, admin=False, authenticated=False)  # auth is on, no valid token (/healthz)
PRINCIPAL = web.RequestKey("principal", Principal)  # set on every request by the middleware


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def bearer_token(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _matches(token: str, accepted: tuple[str, ...]) -> bool:
    given = token.encode("utf-8", "surrogatepass")
    return any(hmac.compare_digest(given, t.encode("utf-8", "surrogatepass")) for t in accepted)


def principal_for(config: AuthConfig, token: str | None) -> Principal | None:
    """Who `token` is; None when auth is on and the token is missing or not accepted."""
    if not config.enabled:
        return ANONYMOUS
    if token is None:
        return None
    if _matches(token, config.admin_tokens):
        return Principal(owner=token_digest(token), admin=True, authenticated=True)
    if _matches(token, config.tokens):
        return Principal(owner=token_digest(token), admin=False, authenticated=True)
    return None


def auth_middleware(config: AuthConfig) -> Middleware:
    """401 without a token, 403 with a wrong one, on /v1 (and /metrics with `protect_metrics`);
    elsewhere (/healthz) a valid token only unlocks details."""

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        token = bearer_token(request)
        principal = principal_for(config, token)
        guarded = request.path.startswith("/v1/") or request.path == "/v1"
        if request.path == "/metrics" and config.protect_metrics:
            guarded = True
            if principal is not None and config.admin_tokens and not principal.admin:
                return error_response(403, "forbidden", "/metrics needs an admin token (auth.admin_tokens)")
        if principal is None and guarded:
            if token is None:
                return error_response(
                    401,
                    "unauthorized",
                    "missing 'Authorization: Bearer <token>'",
                    {"WWW-Authenticate": "Bearer"},
                )
            return error_response(403, "forbidden", "bearer token not accepted")
        request[PRINCIPAL] = principal or NOBODY
        return await handler(request)

    return auth


def principal(request: web.Request) -> Principal:
    """The caller, as the middleware found it (NOBODY if it did not run)."""
    return request.get(PRINCIPAL, NOBODY)
