"""OpenAPI entries of the ICE hand-out (GET /v1/ice-servers, OPTIONS /v1/calls), the `Link` headers on a
created call, and the drain's answers; merged into /openapi.json by `with_net`."""

from __future__ import annotations

from typing import Any

from voicertc.config import Config

JSON = "application/json"
LINK = {
    "description": 'One per ICE server URL (WHIP): `<turn:host:3478?transport=udp>; rel="ice-server"; '
    'username="<expiry>:<id>"; credential="..."; credential-type="password"` (STUN URLs without '
    "credentials).",
    "schema": {"type": "string"},
}


def _ice_servers(config: Config) -> dict[str, Any]:
    ttl = config.turn.ttl_s
    return {
        "get": {
            "summary": "The STUN/TURN servers a client should gather with (RTCIceServer dictionaries).",
            "description": "`[webrtc] ice_servers` as they are, and `[turn] urls` with fresh credentials "
            f"valid {ttl} s (`[turn] ttl_s`) in coturn's TURN REST API scheme: username `<expiry unix "
            "time>:<id>`, credential base64(HMAC-SHA1(`[turn] secret`, username)). Never the secret.",
            "parameters": [
                {
                    "name": "ice_transport_policy",
                    "in": "query",
                    "required": False,
                    "schema": {"enum": ["relay", "all"]},
                    "description": "Echoed as `ice_transport_policy`: `relay` makes the page gather only "
                    "relay candidates (testing the relay).",
                }
            ],
            "responses": {
                "400": {
                    "description": "`ice_transport_policy` is neither relay nor all (`bad_request`).",
                    "content": {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}},
                },
                "200": {
                    "description": "The ICE servers (`[]` when none are configured).",
                    "content": {JSON: {"schema": {"$ref": "#/components/schemas/IceServers"}}},
                },
            },
        }
    }


def _calls_options() -> dict[str, Any]:
    return {
        "summary": "WHIP: the ICE servers as `Link` headers, asked before the offer.",
        "responses": {"204": {"description": "No body; `Link` headers.", "headers": {"Link": LINK}}},
    }


def net_schemas() -> dict[str, Any]:
    string = {"type": "string"}
    server = {
        "type": "object",
        "required": ["urls"],
        "properties": {"urls": {"type": "array", "items": string}, "username": string, "credential": string},
    }
    return {
        "IceServers": {
            "type": "object",
            "required": ["ice_servers"],
            "properties": {
                "ice_servers": {"type": "array", "items": server},
                "ice_transport_policy": {"enum": ["relay", "all"]},
            },
        }
    }


def with_net(paths: dict[str, Any], config: Config) -> dict[str, Any]:
    """`paths` plus the routes of signaling/net.py; the created call's `Link` headers and the drain's
    503 `draining` are written into the existing POST /v1/calls and /readyz entries."""
    post = paths["/v1/calls"]["post"]
    post["responses"]["201"].setdefault("headers", {})["Link"] = LINK
    drained = post["responses"]["503"]
    drained["description"] += " While the server drains (SIGTERM): `draining`, with `Retry-After`."
    paths["/v1/calls"]["options"] = _calls_options()
    ready = paths.get("/readyz", {}).get("get")
    if ready is not None:
        ready["responses"]["503"]["description"] += ' Reason `"draining"` while the server shuts down.'
    return {**paths, "/v1/ice-servers": _ice_servers(config)}
