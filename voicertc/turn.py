"""ICE servers for clients: the configured STUN/TURN URLs plus time-limited TURN credentials.

The credentials follow the TURN REST API scheme that coturn checks with `use-auth-secret` /
`static-auth-secret`: username = "<expiry unix time>:<id>", password = base64(HMAC-SHA1(secret,
username)). The relay recomputes the password from its copy of the secret and refuses a username
whose expiry has passed, so a client never sees the secret and a leaked credential dies after
`[turn] ttl_s`. Pure functions of (config, id, now): the clock is injected.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass

from voicertc.config import Config


@dataclass(frozen=True)
class IceServer:
    """One RTCIceServer as a browser takes it (`urls`, and for TURN `username` + `credential`)."""

    urls: tuple[str, ...]
    username: str | None = None
    credential: str | None = None

    def as_json(self) -> dict[str, object]:
        body: dict[str, object] = {"urls": list(self.urls)}
        if self.username is not None:
            body["username"] = self.username
            body["credential"] = self.credential
        return body

    def link_headers(self) -> list[str]:
        """One WHIP `Link: <url>; rel="ice-server"` value per URL (RFC 9725 section 4.6)."""
        values = []
        for url in self.urls:
            value = f'<{url}>; rel="ice-server"'
            if self.username is not None and self.credential is not None:
                value += (
                    f"; username={_quoted(self.username)}; credential={_quoted(self.credential)}"
                    '; credential-type="password"'
                )
            values.append(value)
        return values


def turn_credentials(secret: str, user_id: str, expiry_s: int) -> tuple[str, str]:
    """(username, password) valid until the unix time `expiry_s` on a relay sharing `secret`."""
    username = f"{expiry_s}:{user_id}"
    digest = hmac.new(secret.encode("utf-8"), username.encode("utf-8"), hashlib.sha1).digest()
    return username, base64.b64encode(digest).decode("ascii")


def ice_servers_for(config: Config, user_id: str, now_s: float) -> list[IceServer]:
    """What a client should use: `[webrtc] ice_servers` as they are (STUN; a TURN URL listed there
    needs no credentials or has its own) and `[turn] urls` with fresh credentials for `user_id`."""
    servers = [IceServer(urls=(url,)) for url in config.webrtc.ice_servers]
    turn = config.turn
    if turn.urls:
        username, credential = turn_credentials(turn.secret, user_id, int(now_s) + turn.ttl_s)
        servers.append(IceServer(urls=turn.urls, username=username, credential=credential))
    return servers


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
