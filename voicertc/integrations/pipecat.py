"""voicertc as a pipecat TTS service (extra `pipecat`).

    from voicertc.integrations.pipecat import VoiceRTCTTSService
    tts = VoiceRTCTTSService(url="http://127.0.0.1:8080", voice=None, token=None)
    pipeline = Pipeline([transport.input(), stt, llm, tts, transport.output()])

`url` is the server's base URL: each text pipecat aggregates (a sentence, by default) is one utterance
on the `/v1/tts/stream` WebSocket, its audio pushed as `TTSAudioRawFrame`s at the pipeline's output
rate as it is made. With `text_aggregation_mode=TextAggregationMode.TOKEN` a whole LLM turn is one
utterance, its tokens going in as text deltas (bistream on CosyVoice2). Handed a running
`VoiceServer` instead of a URL, it speaks on that server's engine in-process. An interruption
cancels the utterance on the server at once. TTFB is pipecat's own metric (start of the request ->
first audio frame); the spoken text goes downstream as pipecat's `TTSTextFrame`s (the base class's
word/text marks).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Any

from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    ErrorFrame,
    Frame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
)
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
        self._turns: dict[str, Any] = {}  # token mode: context id -> the turn's one utterance
        self._tasks: set[asyncio.Task[None]] = set()  # cancels sent, token-mode audio delivery

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
        for utterance in self._turns.values():
            await self._cancel(utterance)
        self._turns.clear()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Sentence mode (pipecat's default): one utterance per text, its audio yielded as it is
        synthesized. Token mode (`text_aggregation_mode=TextAggregationMode.TOKEN`): the turn is one
        utterance; each token goes in as a text delta, the audio arrives through the turn's audio
        context, and the end of the turn (`flush_audio`) ends its input."""
        if self._client is None:
            yield ErrorFrame(error="VoiceRTCTTSService is not started")
            return
        if self._is_streaming_tokens:
            async for frame in self._stream_token(text, context_id):
                yield frame
            return
        utterance = self._client.utterance()
        self._speaking[context_id] = utterance
        finished = False
        try:
            await utterance.say(text)
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

    async def _stream_token(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        assert self._client is not None
        utterance = self._turns.get(context_id)
        if utterance is None:
            utterance = self._turns[context_id] = self._client.utterance()
            self._spawn(self._deliver(context_id, utterance))
        try:
            await utterance.push(text)
        except TtsStreamError as exc:
            yield ErrorFrame(error=f"voicertc: {exc}")
            return
        yield None  # the audio comes through the audio context (_deliver)

    async def flush_audio(self, context_id: str | None = None) -> None:
        """The turn's text is complete (token mode): the server speaks it to the end."""
        utterance = self._turns.get(context_id or self.get_active_audio_context_id() or "")
        if utterance is not None:
            await utterance.flush()

    async def _deliver(self, context_id: str, utterance: Any) -> None:
        """Token mode: the turn utterance's audio into its audio context, then the context's end."""
        try:
            async for pcm in utterance.audio():
                frame = TTSAudioRawFrame(pcm, self.sample_rate, 1, context_id=context_id)
                await self.append_to_audio_context(context_id, frame)
        except TtsStreamError as exc:
            await self.push_frame(ErrorFrame(error=f"voicertc: {exc}"))
        finally:
            if self._turns.get(context_id) is utterance:
                del self._turns[context_id]
            if self.audio_context_available(context_id):
                await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
                await self.remove_audio_context(context_id)

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        for utterances in (self._speaking, self._turns):
            utterance = utterances.pop(context_id, None)
            if utterance is not None:
                self._cancel_soon(utterance)

    def _cancel_soon(self, utterance: Any) -> None:
        """Cancel on the server from a task: this may run inside a cancelled generator."""
        self._spawn(self._cancel(utterance))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cancel(self, utterance: Any) -> None:
        try:
            await utterance.cancel()
        except (TtsStreamError, ConnectionError) as exc:
            logger.debug("voicertc: cancel not sent (%s)", exc)
