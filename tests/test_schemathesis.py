"""schemathesis against the server's own /openapi.json: every documented operation, every built-in check,
a bounded number of generated requests, zero failures (issue 11).

The server runs on the fake engine in a thread of its own (its own event loop), with bearer tokens and
`protect_metrics` on so the auth paths are exercised too; schemathesis talks to it over HTTP.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import requests
import schemathesis
from aiohttp import web
from audio_clips import clip
from call_helpers import PeerClient, fake_config
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.config._checks import (
    MISSING_REQUIRED_HEADER_EXPECTED_STATUSES as MISSING_HEADER_STATUSES,
)
from schemathesis.config._checks import (
    NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES as NEGATIVE_STATUSES,
)
from schemathesis.config._checks import (
    POSITIVE_DATA_ACCEPTANCE_EXPECTED_STATUSES as POSITIVE_STATUSES,
)
from schemathesis.transport.serialization import Binary

from signaling.app import ENGINE, create_app
from signaling.openapi import openapi_spec
from signaling.openapi_facts import EngineFacts
from voicertc.webrtc.speech import engine_features

TOKEN = "schemathesis-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# per operation and phase: bounds the run (well under a minute on 2 shared cores); deeper by hand
MAX_EXAMPLES = int(os.environ.get("SCHEMATHESIS_EXAMPLES", "12"))


@schemathesis.serializer("application/sdp", "application/trickle-ice-sdpfrag", "application/x-ndjson")
def _text_body(_ctx: Any, value: Any) -> bytes:
    """These bodies are text on the wire; a negative case may hand a non-string, sent as its JSON."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text.encode("utf-8", "surrogatepass")


VOICES_DIR = tempfile.TemporaryDirectory(prefix="schemathesis-voices-")  # voice owners land here
CONFIG = fake_config(
    server={"port": 0},
    engine={"voices_dir": VOICES_DIR.name},
    auth={"tokens": [TOKEN], "protect_metrics": True},
    # caps far above what a run registers: a schema-valid registration is answered 201, not 429
    limits={"max_text_chars": 200, "max_voices": 10_000, "max_voices_per_token": 10_000},
    fake={"voice_book": True},
)
# Voice clips (the `audio` of POST /v1/voices): real audio files of several containers, each long
# enough for a transcript of max_text_chars (50 characters per second of clip).
CLIP_SECONDS = CONFIG.limits.max_text_chars / 50 + 0.5
CLIPS = [Binary(clip(fmt, seconds=CLIP_SECONDS)) for fmt in ("wav", "flac", "opus", "mp3")]


class Server:
    """The app on its own loop in a thread, and a live call on it (an in-process browser peer)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="schemathesis-server", daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(create_app(CONFIG))
        self.peers: list[PeerClient] = []

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        return f"http://{host}:{port}"

    async def live_call(self, url: str) -> str:
        """A connected call (data channel open), as a browser makes one."""
        peer = PeerClient()
        self.peers.append(peer)
        async with aiohttp.ClientSession(headers=AUTH) as session:
            body = {"sdp": await peer.offer(), "type": "offer"}
            async with session.post(f"{url}/v1/calls", json=body) as resp:
                assert resp.status == 201, await resp.text()
                answer = await resp.json()
        await peer.accept(answer["sdp"])
        await peer.wait_open()
        return str(answer["id"])

    async def offers(self) -> list[str]:
        """Real SDP offers (what the `sdp-offer` format stands for), recvonly and sendrecv audio."""
        peers = [PeerClient(mic=mic) for mic in (False, True)]
        self.peers += peers
        return [await peer.offer() for peer in peers]

    async def voice(self, url: str, voice_id: str) -> str:
        """A voice registered by this token (so that it may delete it)."""
        form = aiohttp.FormData()
        form.add_field("audio", CLIPS[0].data, filename="clip.wav")
        form.add_field("id", voice_id)
        async with aiohttp.ClientSession(headers=AUTH) as session:
            async with session.post(f"{url}/v1/voices", data=form) as resp:
                assert resp.status == 201, await resp.text()
                return str((await resp.json())["id"])

    def facts(self) -> EngineFacts:
        """This server's engine as the document it serves describes it."""
        engine = self.runner.app[ENGINE]
        return EngineFacts(voices=tuple(engine.voices()), features=tuple(engine_features(engine)))

    async def stop(self) -> None:
        for peer in self.peers:
            await peer.close()
        await self.runner.cleanup()

    def close(self) -> None:
        self.run(self.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


# Started at import: the schema below is generated from this server's engine (its voices and options),
# and schemathesis' lazy fixture loader does not run under this pytest. Closed by `server_url`.
SERVER = Server()
URL = SERVER.run(SERVER.start())
FACTS = SERVER.facts()
schemathesis.openapi.format("sdp-offer", st.sampled_from(SERVER.run(SERVER.offers())))
# what the `speak-ndjson` format stands for: one `{"text": delta}` object per line
schemathesis.openapi.format(
    "speak-ndjson",
    st.lists(st.sampled_from(["Hello", " there,", " how are you?"]), min_size=1, max_size=3).map(
        lambda deltas: "".join(json.dumps({"text": d}) + "\n" for d in deltas)
    ),
)
# what the `sdp-fragment` format stands for: end of candidates, or a host candidate of the live call
schemathesis.openapi.format(
    "sdp-fragment",
    st.sampled_from(
        [
            "a=end-of-candidates\r\n",
            "a=mid:0\r\na=candidate:1 1 udp 2130706431 127.0.0.1 9 typ host\r\n",
        ]
    ),
)
# what an audio upload (`binary`; `byte` in JSON, base64) stands for on this API: a voice clip
schemathesis.openapi.format("binary", st.sampled_from(CLIPS))
schemathesis.openapi.format(
    "byte", st.sampled_from([base64.b64encode(c.data).decode("ascii") for c in CLIPS])
)
CALLS = [SERVER.run(SERVER.live_call(URL)) for _ in range(2)]  # the second one for DELETE (hang-up)
# The document served before the run registers voices (they join the token's voice enum).
SERVED = requests.get(f"{URL}/openapi.json", headers=AUTH, timeout=10).json()
DELETED_VOICE = SERVER.run(SERVER.voice(URL, "schemathesis-delete"))  # for DELETE; not in the voice enum
CHECKS_CONFIG: dict[str, Any] = {
    "request-timeout": 10,
    # 413 is how this API refuses a body over a documented size (text over maxLength, SDP over 64 KiB);
    # 426 how a WebSocket route refuses a request without the upgrade headers its document requires.
    "checks": {
        "negative_data_rejection": {"expected-statuses": [*NEGATIVE_STATUSES, "413", "426"]},
        "missing_required_header": {"expected-statuses": [*MISSING_HEADER_STATUSES, "426"]},
        # 101 Switching Protocols: how a WebSocket route accepts a request with the upgrade headers
        "positive_data_acceptance": {"expected-statuses": [*POSITIVE_STATUSES, "101"]},
        "not_a_server_error": {"expected-statuses": ["101", "2xx", "3xx", "4xx"]},
    },
    # a live call's event stream never ends: its first event (or 0.5 s of it) is the answer under test
    # A live call and a voice of this engine fill the path parameters of every operation.
    "parameters": {"call_id": CALLS[0], "voice_id": FACTS.voices[0]},
    "operations": [
        # a live call's event stream never ends: its first event (or 0.5 s of it) is the answer under test
        {"include-path": "/v1/calls/{call_id}/events", "max-stream-events": 1, "request-timeout": 0.5},
        # `include-name`, not include-method + include-path: those two match either (a union), and would
        # hand GET the call or voice that DELETE ends
        {"include-name": "DELETE /v1/calls/{call_id}", "parameters": {"call_id": CALLS[1]}},
        {"include-name": "DELETE /v1/voices/{voice_id}", "parameters": {"voice_id": DELETED_VOICE}},
    ],
}

# The document the server serves to this token (checked equal below).
schema = schemathesis.openapi.from_dict(
    openapi_spec(CONFIG, FACTS), config=schemathesis.Config.from_dict(CHECKS_CONFIG)
)
load_all_checks()
ALL_CHECKS = list(CHECKS.get_all())


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    try:
        yield URL
    finally:
        SERVER.close()
        VOICES_DIR.cleanup()


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_api(case: schemathesis.Case, server_url: str) -> None:
    case.call_and_validate(base_url=server_url, headers=AUTH, checks=ALL_CHECKS)


def test_the_served_document_is_the_one_tested(server_url: str) -> None:
    assert SERVED == json.loads(json.dumps(openapi_spec(CONFIG, FACTS)))
