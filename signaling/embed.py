"""Run the voicertc server inside an agent process and talk into its calls from Python.

    server = VoiceServer(load_config("config.toml"))
    await server.start()                      # serves the page, the API and WebRTC (`async with` does too)
    call = await server.next_call()           # a browser (or any WHIP client) called in
    utt = call.say(llm_text_deltas())         # a str, or an async iterable of text deltas
    await utt.done()                          # speech.done / speech.interrupted / error event
    call.interrupt()                          # barge-in
    async for event in call.events(): ...     # the same events the data channel carries (+ user.*)
    async for pcm in call.listen(): ...       # the caller's mic: 16 kHz mono int16, 20 ms frames
    info = await server.voices.register(clip_bytes, "its transcript", voice_id="ann")  # zero-shot voice
    call.say("Hi!", voice="ann")              # usable at once; server.voices.list() / get() / delete()
    await server.stop()

Everything runs on the caller's event loop; synthesis runs on the engine's own thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator

import numpy as np
from aiohttp import web

from signaling.app import ENGINE, create_app, http_url, listen_error
from signaling.routes import REGISTRY
from signaling.voice_admin import VoiceAdmin
from signaling.voice_routes import VOICES
from voicertc.config import Config, load_config
from voicertc.engine.protocol import Engine
from voicertc.webrtc.call import Call
from voicertc.webrtc.speech import ClientEvent, SpeechHandle


class AgentCall:
    """One call as an agent sees it; the server keeps one per call. Its events are buffered from the
    moment it was first handed out (`next_call()` or `calls()`) until the call closes."""

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
        self,
        text: str | AsyncIterable[str],
        *,
        voice: str | None = None,
        interrupt: bool = False,
        instruct: str | None = None,
        speed: float | None = None,
    ) -> SpeechHandle:
        """Queue speech (after what is already queued, unless `interrupt`); `await handle.done()` to wait.

        `instruct`: an instruction for the voice (CosyVoice2 instruct2, e.g. "Speak slowly and softly.");
        `speed`: a rate factor 0.5..2 (CosyVoice2), non-streaming only as in the reference: the utterance's
        audio starts after each whole segment is synthesized (InputError on engines without it)."""
        return self._call.speak(text, voice=voice, interrupt=interrupt, instruct=instruct, speed=speed)

    def interrupt(self) -> tuple[str | None, float]:
        """Cut what is playing and drop what is queued: (utterance_id, played_ms)."""
        return self._call.interrupt()

    async def events(self) -> AsyncIterator[ClientEvent]:
        """speech.* / error events, and the caller's user.speech.started / user.speech.stopped /
        user.transcript, until the call ends."""
        while True:
            event = await self._events.get()
            if event is None:
                self._events.put_nowait(None)  # a later events() ends at once too
                return
            yield event

    def listen(self) -> AsyncIterator[np.ndarray]:
        """The caller's microphone as 16 kHz mono int16 frames of 20 ms, until the call closes.

        `[listen] enabled` must be on and the caller must have offered a microphone; unread audio
        beyond `[listen] inbound_buffer_ms` is dropped (oldest first) and counted in /metrics.
        """
        return self._call.listen()

    async def wait_closed(self) -> None:
        await self._call.closed.wait()

    async def hang_up(self) -> None:
        await self._call.close("hung up by the agent")


class VoiceServer:
    """The whole voicertc server (HTTP API, page, engine) on the current event loop."""

    def __init__(self, config: Config | None = None, *, engine: Engine | None = None) -> None:
        self.config = config if config is not None else load_config(None)
        self._app = create_app(self.config, engine)
        self._registry = self._app[REGISTRY]
        self._registry.queue_new_calls = True  # next_call() gets calls answered from the start
        self._agent_calls: dict[str, AgentCall] = {}
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        """Start the engine and listen on `[server] host/port` (port 0 picks one); returns the base URL.

        Idempotent: on a running server (e.g. inside `async with`) it only returns the URL.
        """
        if self._runner is not None:
            return self.url
        runner = web.AppRunner(self._app, handle_signals=False)
        await runner.setup()
        self._runner = runner
        try:
            await web.TCPSite(runner, self.config.server.host, self.config.server.port).start()
        except OSError as exc:
            await self.stop()
            raise listen_error(self.config, exc) from exc
        host, port = runner.addresses[0][:2]
        self.url = http_url(host, port)
        return self.url

    @property
    def voices(self) -> VoiceAdmin:
        """The voice registry: `await list()`, `get(id)`, `register(audio, transcript, voice_id=, name=)`,
        `delete(id)` (the same operations as /v1/voices)."""
        return self._app[VOICES]

    @property
    def engine(self) -> Engine:
        return self._app[ENGINE]

    async def next_call(self, timeout_s: float | None = None) -> AgentCall:
        """Wait for the next call to be answered (calls not taken yet come first)."""
        return self._agent_call(await asyncio.wait_for(self._registry.next_call(), timeout_s))

    def calls(self) -> list[AgentCall]:
        """The calls open now, each the same AgentCall every time it is handed out."""
        return [self._agent_call(call) for call in self._registry.calls.values()]

    def _agent_call(self, call: Call) -> AgentCall:
        agent_call = self._agent_calls.get(call.call_id)
        if agent_call is None:
            agent_call = self._agent_calls[call.call_id] = AgentCall(call)
            call.add_close_listener(lambda closed: self._agent_calls.pop(closed.call_id, None))
        return agent_call

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
