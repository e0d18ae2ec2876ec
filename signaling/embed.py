"""Run the voicertc server inside an agent process and talk into its calls from Python.

    server = VoiceServer(load_config("config.toml"))
    await server.start()                      # serves the page, the API and WebRTC
    call = await server.next_call()           # a browser (or any WHIP client) called in
    utt = call.say(llm_text_deltas())         # a str, or an async iterable of text deltas
    await utt.done()                          # speech.done / speech.interrupted / error event
    call.interrupt()                          # barge-in
    async for event in call.events(): ...     # the same events the data channel carries
    await server.stop()

Everything runs on the caller's event loop; synthesis runs on the engine's own thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator

from aiohttp import web

from signaling.app import ENGINE, create_app
from signaling.routes import REGISTRY
from voicertc.config import Config, load_config
from voicertc.engine.protocol import Engine
from voicertc.webrtc.call import Call
from voicertc.webrtc.speech import ClientEvent, SpeechHandle


class AgentCall:
    """One call as an agent sees it. Events are buffered from the moment `next_call()` returned it."""

    def __init__(self, call: Call) -> None:
        self._call = call
        self._events = call.subscribe()

    @property
    def call_id(self) -> str:
        return self._call.call_id

    @property
    def closed(self) -> bool:
        return self._call.closed.is_set()

    @property
    def state(self) -> str:
        return self._call.state

    def say(
        self, text: str | AsyncIterable[str], *, voice: str | None = None, interrupt: bool = False
    ) -> SpeechHandle:
        """Queue speech (after what is already queued, unless `interrupt`); `await handle.done()` to wait."""
        return self._call.speak(text, voice=voice, interrupt=interrupt)

    def interrupt(self) -> tuple[str | None, float]:
        """Cut what is playing and drop what is queued: (utterance_id, played_ms)."""
        return self._call.interrupt()

    async def events(self) -> AsyncIterator[ClientEvent]:
        """speech.started / speech.done / speech.interrupted / error events until the call ends."""
        while True:
            event = await self._events.get()
            if event is None:
                return
            yield event

    async def wait_closed(self) -> None:
        await self._call.closed.wait()

    async def hang_up(self) -> None:
        await self._call.close("hung up by the agent")


class VoiceServer:
    """The whole voicertc server (HTTP API, page, engine) on the current event loop."""

    def __init__(self, config: Config | None = None, *, engine: Engine | None = None) -> None:
        self.config = config if config is not None else load_config(None)
        self._app = create_app(self.config, engine)
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        """Start the engine and listen on `[server] host/port` (port 0 picks one); returns the base URL."""
        self._runner = web.AppRunner(self._app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.server.host, self.config.server.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    @property
    def engine(self) -> Engine:
        return self._app[ENGINE]  # type: ignore[return-value]

    async def next_call(self, timeout_s: float | None = None) -> AgentCall:
        """Wait for the next call to be answered (calls not taken yet come first)."""
        registry = self._app[REGISTRY]
        return AgentCall(await asyncio.wait_for(registry.next_call(), timeout_s))

    def calls(self) -> list[AgentCall]:
        """The calls open now (fresh wrappers: their events start from now)."""
        return [AgentCall(call) for call in self._app[REGISTRY].calls.values()]

    async def stop(self) -> None:
        """Close every call, stop the engine (when the server made it), stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> VoiceServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
