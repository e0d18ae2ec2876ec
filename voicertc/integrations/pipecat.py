"""voicertc as a pipecat TTS service (extra `pipecat`).

    from voicertc.integrations.pipecat import VoiceRTCTTSService
    tts = VoiceRTCTTSService(url="http://127.0.0.1:8080", voice=None, token=None)
    pipeline = Pipeline([transport.input(), stt, llm, tts, transport.output()])

`url` is the server's base URL: each text pipecat aggregates (a sentence, by default) is one utterance
on the `/v1/tts/stream` WebSocket, its audio pushed as `TTSAudioRawFrame`s at the pipeline's output
rate as it is made. Handed a running `VoiceServer` instead of a URL, it speaks on that server's engine
in-process. An interruption cancels the utterance on the server at once. TTFB is pipecat's own metric
(start of the request -> first audio frame); the spoken text goes downstream as pipecat's
`TTSTextFrame`s (the base class's word/text marks).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Any

from pipecat.frames.frames import CancelFrame, EndFrame, ErrorFrame, Frame, StartFrame, TTSAudioRawFrame
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TTSService

from voicertc.integrations.inprocess import InProcessTtsClient
from voicertc.integrations.ws_client import TtsStreamClient, TtsStreamError

logger = logging.getLogger(__name__)


class VoiceRTCTTSService(TTSService):
    """pipecat `TTSService` over voicertc. `voice` None = the server's default voice; `token` = the
    bearer token when the server has `[auth] tokens`; `instruct` = CosyVoice2 instruct2."""

    def __init__(
        self,
        *,
        url: Any,
        voice: str | None = None,
        token: str | None = None,
        instruct: str | None = None,
        sample_rate: int | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("settings", TTSSettings(model="voicertc", voice=voice, language=None))
        super().__init__(sample_rate=sample_rate, push_start_frame=True, push_stop_frames=True, **kwargs)
        self._url = url
        self._voice = voice
        self._token = token
        self._instruct = instruct
        self._client: TtsStreamClient | InProcessTtsClient | None = None
        self._speaking: dict[str, Any] = {}  # context id -> its utterance while run_tts streams it
        self._cancels: set[asyncio.Task[None]] = set()

    def can_generate_metrics(self) -> bool:
        return True

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        rate = self.sample_rate  # the pipeline's output rate, known only now
        if isinstance(self._url, str):
            self._client = TtsStreamClient(
                self._url, token=self._token, voice=self._voice, sample_rate_hz=rate, instruct=self._instruct
            )
        else:
            self._client = InProcessTtsClient(
                self._url, voice=self._voice, sample_rate_hz=rate, instruct=self._instruct
            )
        await self._client.connect()

    async def stop(self, frame: EndFrame) -> None:
        await super().stop(frame)
        await self._close()

    async def cancel(self, frame: CancelFrame) -> None:
        await super().cancel(frame)
        await self._close()

    async def _close(self) -> None:
        if self._cancels:
            await asyncio.gather(*self._cancels, return_exceptions=True)
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """One utterance: the text in, its audio out as it is synthesized."""
        if self._client is None:
            yield ErrorFrame(error="VoiceRTCTTSService is not started")
            return
        utterance = self._client.utterance()
        self._speaking[context_id] = utterance
        finished = False
        try:
            await utterance.push(text)
            await utterance.flush()
            await self.start_tts_usage_metrics(text)
            async for pcm in utterance.audio():
                yield TTSAudioRawFrame(pcm, self.sample_rate, 1, context_id=context_id)
            finished = True
        except TtsStreamError as exc:
            finished = True
            yield ErrorFrame(error=f"voicertc: {exc}")
        finally:
            self._speaking.pop(context_id, None)
            if not finished:  # interrupted (the task was cancelled) or the consumer stopped early
                self._cancel_soon(utterance)

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        utterance = self._speaking.pop(context_id, None)
        if utterance is not None:
            self._cancel_soon(utterance)

    def _cancel_soon(self, utterance: Any) -> None:
        """Cancel on the server from a task: this may run inside a cancelled generator."""
        task = asyncio.get_running_loop().create_task(self._cancel(utterance))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _cancel(self, utterance: Any) -> None:
        try:
            await utterance.cancel()
        except (TtsStreamError, ConnectionError) as exc:
            logger.debug("voicertc: cancel not sent (%s)", exc)
