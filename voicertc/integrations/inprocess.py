"""The adapters' client on an engine in this process (a `VoiceServer` handed to them): the same
interface as `ws_client.TtsStreamClient` (utterance(): push / flush / cancel / audio), no socket.
Runs on the server's event loop; synthesis stays on the engine's thread."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from voicertc.engine.protocol import Engine, Failed
from voicertc.errors import VoiceRTCError
from voicertc.integrations.ws_client import TtsStreamError
from voicertc.streaming import SpeechStream
from voicertc.validate import BadTextError, check_text
from voicertc.webrtc.speech import speak_options


class InProcessUtterance:
    """One utterance on the engine; opened at its first text. Owned by the event loop."""

    def __init__(self, client: InProcessTtsClient) -> None:
        self._client = client
        self.stream: SpeechStream | None = None
        self.text_chars = 0
        self.flushed = False
        self.error: TtsStreamError | None = None

    @property
    def utterance_id(self) -> str | None:
        return self.stream.utterance_id if self.stream is not None else None

    @property
    def ttfa_ms(self) -> float | None:
        return self.stream.ttfa_ms if self.stream is not None else None

    async def push(self, text: str, end: bool = False) -> None:
        """Append text; `end=True`: it is the last (as `flush`, in the same engine command)."""
        if not text or self.flushed or self.error is not None:
            return
        try:
            check_text(text, "text")
        except BadTextError as exc:
            raise TtsStreamError(exc.code, str(exc)) from None
        self.text_chars += len(text)
        if self.text_chars > self._client.max_text_chars:
            self.error = TtsStreamError(
                "text_too_long", f"more than {self._client.max_text_chars} characters"
            )
            await self.cancel()
            return
        if self.stream is None:
            self.stream = self._client.open_stream()
        self.flushed = end
        self.stream.push(text, end)

    async def say(self, text: str) -> None:
        """The whole text at once: pushed with its end as one command, so the engine speaks it whole."""
        await self.push(text, end=True)
        if not self.flushed:  # nothing pushed (empty text, or it failed): end it all the same
            await self.flush()

    async def flush(self) -> None:
        self.flushed = True
        if self.stream is not None:
            self.stream.end_input()

    async def cancel(self) -> None:
        if self.stream is not None:
            self.stream.cancel()

    async def audio(self) -> AsyncIterator[bytes]:
        if self.stream is not None:
            async for pcm in self.stream.chunks():
                yield pcm
            outcome = self.stream.outcome
            if isinstance(outcome, Failed) and self.error is None:
                self.error = TtsStreamError(outcome.code, outcome.message)
        if self.error is not None:
            raise self.error


class InProcessTtsClient:
    """`server`: anything with `.engine` (and `.config`), e.g. `signaling.embed.VoiceServer`."""

    def __init__(
        self,
        server: Any,
        *,
        voice: str | None = None,
        sample_rate_hz: int = 24_000,
        instruct: str | None = None,
    ) -> None:
        self.engine: Engine = server.engine
        config = getattr(server, "config", None)
        self.max_text_chars = config.limits.max_text_chars if config is not None else 20_000
        self.trim_leading_ms = config.webrtc.trim_leading_silence_ms if config is not None else 0.0
        self.voice = voice
        self.sample_rate_hz = sample_rate_hz
        try:
            self.options = speak_options(self.engine, instruct, None)
        except VoiceRTCError as exc:
            raise TtsStreamError(exc.code, str(exc)) from None

    def utterance(self) -> InProcessUtterance:
        return InProcessUtterance(self)

    def open_stream(self) -> SpeechStream:
        stream = SpeechStream(
            self.engine,
            voice=self.voice,
            options=self.options,
            sample_rate_hz=self.sample_rate_hz,
            trim_leading_ms=self.trim_leading_ms,
        )
        try:
            stream.open()
        except VoiceRTCError as exc:
            raise TtsStreamError(exc.code, str(exc)) from None
        return stream

    async def connect(self) -> None:
        """Checks the voice now (the WebSocket client's connect does the same)."""
        try:
            self.engine.resolve_voice(self.voice)
        except VoiceRTCError as exc:
            raise TtsStreamError(exc.code, str(exc)) from None

    async def cancel(self) -> None:
        """Nothing session-wide to stop: each utterance cancels itself."""

    async def close(self) -> None:
        pass
