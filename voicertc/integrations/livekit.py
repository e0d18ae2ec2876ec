"""voicertc as a LiveKit Agents TTS (extra `livekit`).

    from voicertc.integrations.livekit import TTS
    session = AgentSession(stt=..., llm=..., tts=TTS(url="http://127.0.0.1:8080", voice=None, token=None))

`streaming=True`: `stream()` sends the LLM's text as it comes (`push_text` / `flush` / `end_input`) on a
`/v1/tts/stream` WebSocket and emits the audio as it is made; `synthesize(text)` is one utterance on the
same kind of socket. Each stream has its own socket (closing it cancels the utterance on the server at
once), opened through the plugin's own aiohttp session, so the object works outside a LiveKit job.
Handed a running `VoiceServer` instead of a URL, it speaks on that server's engine in-process.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from livekit.agents import (
    DEFAULT_API_CONNECT_OPTIONS,
    APIConnectionError,
    APIConnectOptions,
    APIError,
    tts,
    utils,
)

from voicertc.integrations.inprocess import InProcessTtsClient
from voicertc.integrations.ws_client import TtsStreamClient, TtsStreamError

PCM_MIME = "audio/pcm"


class TTS(tts.TTS):
    """LiveKit Agents `tts.TTS` over voicertc. `voice` None = the server's default voice; `token` =
    the bearer token when the server has `[auth] tokens`; `instruct` = CosyVoice2 instruct2."""

    def __init__(
        self,
        *,
        url: Any,
        voice: str | None = None,
        token: str | None = None,
        sample_rate: int = 24_000,
        instruct: str | None = None,
        http_session: aiohttp.ClientSession | None = None,
    ) -> None:
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True), sample_rate=sample_rate, num_channels=1
        )
        self._url = url
        self._voice = voice
        self._token = token
        self._instruct = instruct
        self._session = http_session
        self._owns_session = http_session is None
        self._streams: set[Any] = set()  # open streams, closed by aclose()

    @property
    def model(self) -> str:
        return "voicertc"

    @property
    def provider(self) -> str:
        return "voicertc"

    def _client(self) -> TtsStreamClient | InProcessTtsClient:
        if not isinstance(self._url, str):
            return InProcessTtsClient(
                self._url, voice=self._voice, sample_rate_hz=self.sample_rate, instruct=self._instruct
            )
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()  # its own: usable outside a LiveKit job context
            self._owns_session = True
        return TtsStreamClient(
            self._url,
            token=self._token,
            voice=self._voice,
            sample_rate_hz=self.sample_rate,
            instruct=self._instruct,
            session=self._session,
        )

    def synthesize(
        self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> ChunkedStream:
        stream = ChunkedStream(tts=self, input_text=text, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> SynthesizeStream:
        stream = SynthesizeStream(tts=self, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    async def aclose(self) -> None:
        """Close every open stream (their utterances are cancelled on the server) and the session."""
        streams, self._streams = list(self._streams), set()
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None


def _api_error(exc: TtsStreamError) -> APIError:
    if exc.code == "connection_lost":
        return APIConnectionError(str(exc))
    retryable = exc.code in ("engine_busy", "engine_unavailable")
    return APIError(f"voicertc: {exc}", body={"code": exc.code, "message": exc.message}, retryable=retryable)


class ChunkedStream(tts.ChunkedStream):
    """`synthesize(text)`: one utterance, its audio pushed as it comes."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._voicertc = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        client = self._voicertc._client()
        output_emitter.initialize(
            request_id=utils.shortuuid(),
            sample_rate=self._voicertc.sample_rate,
            num_channels=1,
            mime_type=PCM_MIME,
        )
        try:
            utterance = client.utterance()
            await utterance.say(self.input_text)
            async for pcm in utterance.audio():
                output_emitter.push(pcm)
            output_emitter.flush()
        except TtsStreamError as exc:
            raise _api_error(exc) from None
        except aiohttp.ClientError as exc:
            raise APIConnectionError(f"voicertc: {exc}") from exc
        finally:
            await client.close()  # a cancelled run (aclose) closes the socket: the server cancels
            self._voicertc._streams.discard(self)


class SynthesizeStream(tts.SynthesizeStream):
    """`stream()`: LLM text in (`push_text`, `flush` / `end_input`), audio out as it is made, one
    utterance (segment) per stream."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._voicertc = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        request_id = utils.shortuuid()
        output_emitter.initialize(
            request_id=request_id,
            sample_rate=self._voicertc.sample_rate,
            num_channels=1,
            mime_type=PCM_MIME,
            stream=True,
        )
        output_emitter.start_segment(segment_id=request_id)
        client = self._voicertc._client()
        utterance = client.utterance()

        async def send_text() -> None:
            await client.connect()  # before the first token: the handshake is not in the TTFA
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    break  # one segment per stream: the first flush ends its text
                self._mark_started()
                await utterance.push(data)
            await utterance.flush()

        async def receive_audio() -> None:
            async for pcm in utterance.audio():
                output_emitter.push(pcm)
            output_emitter.end_segment()

        tasks = [asyncio.ensure_future(send_text()), asyncio.ensure_future(receive_audio())]
        try:
            await asyncio.gather(*tasks)
        except TtsStreamError as exc:
            raise _api_error(exc) from None
        except aiohttp.ClientError as exc:
            raise APIConnectionError(f"voicertc: {exc}") from exc
        finally:
            await utils.aio.cancel_and_wait(*tasks)
            await client.close()
            self._voicertc._streams.discard(self)
