"""The client side of `GET /v1/tts/stream`, shared by the pipecat and LiveKit Agents adapters.

    client = TtsStreamClient("http://127.0.0.1:8080", token=None, voice=None, sample_rate_hz=24000)
    utt = client.utterance()
    await utt.push("Hello "); await utt.push("there."); await utt.flush()
    async for pcm in utt.audio(): ...        # PCM16 LE mono bytes at sample_rate_hz, as it is made
    await client.close()

One event loop owns a client. Utterances are spoken in the order they were made, one after another;
only the newest may still take text. `cancel()` stops every utterance of the session (the server's
`cancel`). The socket is opened at the first use and again after it was lost.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

_END = None  # end of an utterance's audio queue


class TtsStreamError(Exception):
    """The server refused or failed an utterance (`code` as in the API), or the socket was lost."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ClientUtterance:
    """One utterance of a session, as the client sees it. Owned by the client's event loop."""

    def __init__(self, client: TtsStreamClient) -> None:
        self._client = client
        self.utterance_id: str | None = None  # known once the server queued it (speech.queued)
        self.ttfa_ms: float | None = None  # the server's first text -> first audio
        self.audio_ms = 0.0
        self.interrupted = False
        self.error: TtsStreamError | None = None
        self.marks: list[tuple[str, float]] = []  # (text, audio_ms where its audio starts): speech.mark
        self.text_sent = False
        self.flushed = False
        self.finished = asyncio.Event()
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def push(self, text: str) -> None:
        """Send a text delta (an empty one is not sent)."""
        if not text or self.flushed or self.finished.is_set():
            return
        await self._client._send_delta(self, text)

    async def say(self, text: str) -> None:
        """The whole text at once: one message (`text.delta` with `flush`), so the engine sees the text
        and its end together (no streamed-text mode for a text that is complete)."""
        if self.flushed or self.finished.is_set():
            return
        if not text:
            await self.flush()
            return
        self.flushed = True
        await self._client._send_delta(self, text, flush=True)

    async def flush(self) -> None:
        """No more text: the server speaks it to the end. An utterance without text ends at once."""
        if self.flushed:
            return
        self.flushed = True
        if not self.text_sent:
            self._finish()
            return
        await self._client._send({"type": "text.flush"})

    async def cancel(self) -> None:
        """Stop this utterance (and the rest of the session's) on the server now."""
        if self.finished.is_set() or not self.text_sent:
            self._finish(interrupted=True)
            return
        await self._client.cancel()

    async def audio(self) -> AsyncIterator[bytes]:
        """PCM16 LE mono pieces until the utterance ends; TtsStreamError if it failed."""
        while True:
            pcm = await self._queue.get()
            if pcm is _END:
                break
            yield pcm
        if self.error is not None:
            raise self.error

    def _audio(self, pcm: bytes) -> None:
        if not self.finished.is_set():
            self.audio_ms += 1000.0 * len(pcm) / (2 * self._client.sample_rate_hz)
            self._queue.put_nowait(pcm)

    def _finish(self, *, interrupted: bool = False, error: TtsStreamError | None = None) -> None:
        if self.finished.is_set():
            return
        self.interrupted = interrupted
        self.error = error
        self.finished.set()
        self._queue.put_nowait(_END)


class TtsStreamClient:
    """A /v1/tts/stream session. `url` is the server's base URL (http:// or https://)."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        voice: str | None = None,
        sample_rate_hz: int = 24_000,
        instruct: str | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        base = url.rstrip("/")
        self.ws_url = base.replace("https://", "wss://", 1).replace("http://", "ws://", 1) + "/v1/tts/stream"
        self.token = token
        self.voice = voice
        self.sample_rate_hz = sample_rate_hz
        self.instruct = instruct
        self._session = session
        self._owns_session = session is None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()
        self._awaiting_id: deque[ClientUtterance] = deque()  # sent text, no speech.queued yet
        self._by_id: dict[str, ClientUtterance] = {}
        self._current: ClientUtterance | None = None  # whose audio the binary frames are
        self._ready: asyncio.Future[dict[str, Any]] | None = None  # session.created/updated reply

    def utterance(self) -> ClientUtterance:
        return ClientUtterance(self)

    async def connect(self) -> None:
        """Open the socket and apply voice / sample rate / instruct (idempotent while open)."""
        async with self._connecting:
            if self._ws is not None and not self._ws.closed:
                return
            if self._session is None or self._session.closed:
                self._session = aiohttp.ClientSession()
                self._owns_session = True
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._ws = await self._session.ws_connect(self.ws_url, headers=headers, max_msg_size=0)
            self._ready = asyncio.get_running_loop().create_future()
            self._reader = asyncio.ensure_future(self._read(self._ws))
            await self._ready
            update: dict[str, Any] = {"type": "session.update", "sample_rate": self.sample_rate_hz}
            if self.voice:
                update["voice"] = self.voice
            if self.instruct:
                update["instruct"] = self.instruct
            self._ready = asyncio.get_running_loop().create_future()
            await self._ws.send_json(update)
            reply = await self._ready
            if reply.get("type") == "error":
                await self._ws.close()
                raise TtsStreamError(reply.get("code", "error"), reply.get("message", ""))

    async def cancel(self) -> None:
        """The server's `cancel`: every utterance of the session stops, buffered text is dropped."""
        if self._ws is not None and not self._ws.closed:
            await self._send({"type": "cancel"})

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def _send_delta(self, utt: ClientUtterance, text: str, flush: bool = False) -> None:
        await self.connect()
        if not utt.text_sent:
            utt.text_sent = True
            self._awaiting_id.append(utt)
        message: dict[str, Any] = {"type": "text.delta", "text": text}
        if flush:
            message["flush"] = True
        await self._send(message)

    async def _send(self, message: dict[str, Any]) -> None:
        if self._ws is None or self._ws.closed:
            raise TtsStreamError("connection_lost", "the TTS WebSocket is closed")
        await self._ws.send_json(message)

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        try:
            async for message in ws:
                if message.type == aiohttp.WSMsgType.BINARY:
                    if self._current is not None:
                        self._current._audio(message.data)
                elif message.type == aiohttp.WSMsgType.TEXT:
                    self._dispatch(message.json())
        finally:
            lost = TtsStreamError("connection_lost", f"the TTS WebSocket closed (code {ws.close_code})")
            if self._ready is not None and not self._ready.done():
                self._ready.set_result({"type": "error", "code": lost.code, "message": lost.message})
            for utt in [*self._awaiting_id, *self._by_id.values()]:
                utt._finish(error=lost)
            self._awaiting_id.clear()
            self._by_id.clear()
            self._current = None

    def _dispatch(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind in ("session.created", "session.updated"):
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(event)
            return
        uid = event.get("utterance_id")
        if kind == "error" and uid is None:
            self._session_error(event)
            return
        if not isinstance(uid, str):
            return
        if kind == "speech.queued":
            if self._awaiting_id:
                queued = self._awaiting_id.popleft()
                queued.utterance_id = uid
                self._by_id[uid] = queued
            return
        utt = self._by_id.get(uid)
        if utt is None:
            return
        if kind == "speech.started":
            self._current = utt
            utt.ttfa_ms = event.get("ttfa_ms")
        elif kind == "speech.mark":
            utt.marks.append((str(event.get("text", "")), float(event.get("audio_ms", 0.0))))
        elif kind == "speech.audio.delta":
            utt._audio(base64.b64decode(event["audio"]))
        elif kind in ("speech.done", "error"):
            self._by_id.pop(uid, None)
            if self._current is utt:
                self._current = None
            error = TtsStreamError(event["code"], event.get("message", "")) if kind == "error" else None
            utt._finish(interrupted=bool(event.get("interrupted")), error=error)

    def _session_error(self, event: dict[str, Any]) -> None:
        """A refused message: a session.update during connect, else the text of the oldest utterance
        still waiting for its id (the only messages a client of this class sends are text)."""
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(event)
            return
        logger.warning("tts stream: %s: %s", event.get("code"), event.get("message"))
        if self._awaiting_id:
            utt = self._awaiting_id.popleft()
            utt._finish(error=TtsStreamError(event.get("code", "error"), event.get("message", "")))
