"""schemathesis against the server's own /openapi.json: every documented operation, every built-in check,
a bounded number of generated requests, zero failures (issue 11).

The server runs on the fake engine in a thread of its own (its own event loop), with bearer tokens and
`protect_metrics` on so the auth paths are exercised too; schemathesis talks to it over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from aiohttp import web
from call_helpers import fake_config
from hypothesis import HealthCheck, settings
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.config._checks import (
    NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES as NEGATIVE_STATUSES,
)
from schemathesis.config._checks import (
    POSITIVE_DATA_ACCEPTANCE_EXPECTED_STATUSES as POSITIVE_STATUSES,
)

from signaling.app import create_app
from signaling.openapi import openapi_spec

TOKEN = "schemathesis-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_EXAMPLES = 12  # per operation and phase: bounds the run (well under a minute on 2 shared cores)


@schemathesis.serializer("application/sdp", "application/trickle-ice-sdpfrag", "application/x-ndjson")
def _text_body(_ctx: Any, value: Any) -> bytes:
    """These bodies are text on the wire; a negative case may hand a non-string, sent as its JSON."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text.encode("utf-8", "surrogatepass")


CONFIG = fake_config(
    server={"port": 0},
    auth={"tokens": [TOKEN], "protect_metrics": True},
    limits={"max_text_chars": 200},
)


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="schemathesis-server", daemon=True)
    thread.start()
    runner = web.AppRunner(create_app(CONFIG))

    async def start() -> str:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    url = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


# /v1/audio/speech: a schema-valid voice, `instructions` or `speed` may still be one the engine does not
# have or honour (a 400 naming it), which the schema cannot know
_MEDIA_BODIES = [("POST", "/v1/calls"), ("POST", "/v1/voices"), ("POST", "/v1/audio/speech")]
CHECKS_CONFIG: dict[str, Any] = {
    # 413 is how this API refuses a body over a documented size (text over maxLength, SDP over 64 KiB).
    "checks": {"negative_data_rejection": {"expected-statuses": [*NEGATIVE_STATUSES, "413"]}},
    # An SDP offer or an audio clip can match its schema (a string) and still not be SDP or audio: JSON
    # Schema cannot say what a usable offer or a decodable clip is, so a 400 naming the problem is a
    # right answer to a schema-valid one. Everything else about these operations is checked as usual.
    "operations": [
        {
            "include-method": method,
            "include-path": path,
            "checks": {"positive_data_acceptance": {"expected-statuses": [*POSITIVE_STATUSES, "400"]}},
        }
        for method, path in _MEDIA_BODIES
    ]
    + [
        # a WebSocket: plain HTTP (what schemathesis sends) cannot open it, 426 says so
        {
            "include-method": "GET",
            "include-path": "/v1/tts/stream",
            "checks": {"positive_data_acceptance": {"expected-statuses": [*POSITIVE_STATUSES, "426"]}},
        }
    ],
}

# The document the server serves (checked equal below); loaded at import, as schemathesis' lazy
# fixture loader does not run under this pytest.
schema = schemathesis.openapi.from_dict(
    openapi_spec(CONFIG), config=schemathesis.Config.from_dict(CHECKS_CONFIG)
)
load_all_checks()
ALL_CHECKS = list(CHECKS.get_all())


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_api(case: schemathesis.Case, server_url: str) -> None:
    case.call_and_validate(base_url=server_url, headers=AUTH, checks=ALL_CHECKS, timeout=10)


def test_the_served_document_is_the_one_tested(server_url: str) -> None:
    import requests

    served = requests.get(f"{server_url}/openapi.json", timeout=10).json()
    assert served == json.loads(json.dumps(openapi_spec(CONFIG)))
