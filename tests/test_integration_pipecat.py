"""`VoiceRTCTTSService` in a real pipecat pipeline (pipecat's own worker and runner, no transport),
against the server on loopback (fake engine) and in-process on a `VoiceServer`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from api_helpers import api
from call_helpers import fake_config

pytest.importorskip("pipecat")

from pipecat.frames.frames import (  # noqa: E402
    EndFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    MetricsFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.metrics.metrics import TTFBMetricsData  # noqa: E402
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402

from signaling.app import ENGINE  # noqa: E402
from signaling.embed import VoiceServer  # noqa: E402
from voicertc.engine.fake import MS_PER_CHAR  # noqa: E402
from voicertc.integrations.pipecat import VoiceRTCTTSService  # noqa: E402

PIPELINE_RATE_HZ = 16_000
SPEAK = "Hello there."
LLM_DELTAS = ["Sure", ", I can ", "help you."]


class Recorder(FrameProcessor):
    """Passes every frame on and keeps the ones going downstream (the pipeline's source and sink)."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[Frame] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            self.frames.append(frame)
        await self.push_frame(frame, direction)

    def of(self, kind: type) -> list:
        return [f for f in self.frames if isinstance(f, kind)]


def pipeline(tts: VoiceRTCTTSService) -> tuple[PipelineWorker, WorkerRunner, Recorder]:
    sink = Recorder()
    worker = PipelineWorker(
        Pipeline([Recorder(), tts, sink]),
        params=PipelineParams(audio_out_sample_rate=PIPELINE_RATE_HZ, enable_metrics=True),
    )
    return worker, WorkerRunner(handle_sigint=False), sink


def speak_and_stream_frames() -> list[Frame]:
    return [
        TTSSpeakFrame(SPEAK),
        LLMFullResponseStartFrame(),
        *[LLMTextFrame(delta) for delta in LLM_DELTAS],
        LLMFullResponseEndFrame(),
        EndFrame(),
    ]


async def wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout_s} s")


def audio_seconds(frames: list[TTSAudioRawFrame]) -> float:
    return sum(len(f.audio) for f in frames) / 2 / PIPELINE_RATE_HZ


async def test_speak_and_llm_text_frames_become_audio_at_the_pipeline_rate():
    async with api() as client:
        url = str(client.make_url("/")).rstrip("/")
        worker, runner, sink = pipeline(VoiceRTCTTSService(url=url))
        await runner.add_workers(worker)
        await worker.queue_frames(speak_and_stream_frames())
        await asyncio.wait_for(runner.run(), 30)
        engine = client.app[ENGINE]
        assert engine.stats["done"] == 2 and engine.open_count == 0  # one utterance per sentence
    audio = sink.of(TTSAudioRawFrame)
    assert audio and {(f.sample_rate, f.num_channels) for f in audio} == {(PIPELINE_RATE_HZ, 1)}
    expected_s = MS_PER_CHAR * (len(SPEAK) + len("".join(LLM_DELTAS))) / 1000
    assert abs(audio_seconds(audio) - expected_s) < 0.1, audio_seconds(audio)
    assert len(sink.of(TTSStartedFrame)) == 2 and len(sink.of(TTSStoppedFrame)) == 2
    assert [f.text for f in sink.of(TTSTextFrame)] == [SPEAK, "".join(LLM_DELTAS)]
    ttfb = [
        d for f in sink.of(MetricsFrame) for d in f.data if isinstance(d, TTFBMetricsData) and d.value > 0
    ]
    assert len(ttfb) == 2  # pipecat's own TTFB metric, once per utterance


async def test_an_interruption_cancels_the_utterance_on_the_server():
    async with api(fake={"ttfa_ms": 20, "rtf": 1.0, "chunk_ms": 100}) as client:
        engine = client.app[ENGINE]
        url = str(client.make_url("/")).rstrip("/")
        worker, runner, sink = pipeline(VoiceRTCTTSService(url=url))
        await runner.add_workers(worker)
        running = asyncio.ensure_future(runner.run())
        await worker.queue_frame(TTSSpeakFrame("A long answer that the caller will cut off. " * 4))
        await wait_until(lambda: bool(sink.of(TTSAudioRawFrame)), 10.0)
        assert engine.open_count == 1
        await worker.queue_frame(InterruptionFrame())
        # it would run ~10 s more; the worker counts the cancel when it applies it (open_count drops first)
        await wait_until(lambda: engine.open_count == 0 and engine.stats["cancelled"] == 1, 2.0)
        heard = audio_seconds(sink.of(TTSAudioRawFrame))
        await worker.queue_frame(EndFrame())
        await asyncio.wait_for(running, 30)
    assert heard < 3.0


async def test_in_process_on_a_voice_server():
    async with VoiceServer(fake_config(server={"port": 0})) as server:
        worker, runner, sink = pipeline(VoiceRTCTTSService(url=server))
        await runner.add_workers(worker)
        await worker.queue_frames(speak_and_stream_frames())
        await asyncio.wait_for(runner.run(), 30)
        assert server.engine.open_count == 0
    expected_s = MS_PER_CHAR * (len(SPEAK) + len("".join(LLM_DELTAS))) / 1000
    assert abs(audio_seconds(sink.of(TTSAudioRawFrame)) - expected_s) < 0.1


async def test_token_mode_speaks_a_whole_llm_turn_as_one_utterance():
    from pipecat.services.tts_service import TextAggregationMode

    turn = ["Sure", ", I can ", "help you. Anything ", "else?"]
    async with api() as client:
        engine = client.app[ENGINE]
        url = str(client.make_url("/")).rstrip("/")
        tts = VoiceRTCTTSService(url=url, text_aggregation_mode=TextAggregationMode.TOKEN)
        worker, runner, sink = pipeline(tts)
        await runner.add_workers(worker)
        await worker.queue_frames(
            [
                TTSSpeakFrame(SPEAK),
                LLMFullResponseStartFrame(),
                *[LLMTextFrame(token) for token in turn],
                LLMFullResponseEndFrame(),
                EndFrame(),
            ]
        )
        await asyncio.wait_for(runner.run(), 30)
        assert engine.stats["utterances"] == 2 and engine.stats["done"] == 2  # the speak, the turn
        assert engine.open_count == 0
    expected_s = MS_PER_CHAR * (len(SPEAK) + len("".join(turn))) / 1000
    assert abs(audio_seconds(sink.of(TTSAudioRawFrame)) - expected_s) < 0.15
    assert len(sink.of(TTSStartedFrame)) == 2 and len(sink.of(TTSStoppedFrame)) == 2


async def test_token_mode_interruption_cancels_the_turn_on_the_server():
    from pipecat.services.tts_service import TextAggregationMode

    async with api(fake={"ttfa_ms": 20, "rtf": 1.0, "chunk_ms": 100}) as client:
        engine = client.app[ENGINE]
        url = str(client.make_url("/")).rstrip("/")
        tts = VoiceRTCTTSService(url=url, text_aggregation_mode=TextAggregationMode.TOKEN)
        worker, runner, sink = pipeline(tts)
        await runner.add_workers(worker)
        running = asyncio.ensure_future(runner.run())
        await worker.queue_frames(
            [LLMFullResponseStartFrame(), *[LLMTextFrame("a long answer, word by word, ") for _ in range(6)]]
        )
        await wait_until(lambda: bool(sink.of(TTSAudioRawFrame)), 10.0)
        assert engine.open_count == 1  # the turn's input is still open: no end of response yet
        await worker.queue_frame(InterruptionFrame())
        await wait_until(lambda: engine.open_count == 0 and engine.stats["cancelled"] == 1, 2.0)
        await worker.queue_frame(EndFrame())
        await asyncio.wait_for(running, 30)
