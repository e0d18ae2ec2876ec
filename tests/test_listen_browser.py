"""Two-way calls in real Chromium: a fake microphone plays a WAV synthesized at test time by the bundled
Piper voice (a backchannel, a question, silence around them) into the page's call. Checks the speech
edges, the transcript, "speech" barge-in (the browser quiet within 400 ms of the caller's onset) and
"words" barge-in (the backchannel does not cut, the question does), with heard_text a prefix."""

from __future__ import annotations

import contextlib
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
from browser_helpers import running_server, wait_for, write_config
from listen_helpers import caller_clip, wer, write_wav

from bench.peer import CHROMIUM, CHROMIUM_ARGS

pytestmark = [pytest.mark.browser, pytest.mark.slow]

QUESTION = "What time does the museum open on Sunday?"
BACKCHANNEL = "Okay."
LONG_REPLY = (
    "Let me tell you about the museum. It has three floors of paintings, a sculpture garden, and a small "
    "cafe near the entrance. The first floor holds the modern collection, with works from the last "
    "century. The second floor is about local history, and the third floor hosts visiting exhibitions. "
    "Guided tours start every hour, and they take about forty five minutes."
)
EDGE_MS = 150.0
LOUD_RMS = 0.01
BARGE_IN_MS = 400.0


def server_config(barge_in: str, min_speech_ms: int = 200) -> Path:
    return write_config(
        '[server]\nport = 0\n[webrtc]\nloopback_only = true\n[engine]\nbackend = "piper"\n'
        f'[listen]\nbarge_in = "{barge_in}"\nmin_speech_ms = {min_speech_ms}\n[logging]\nlevel = "WARNING"\n'
    )


@contextlib.asynccontextmanager
async def page_with_mic(wav: Path):
    from playwright.async_api import async_playwright

    args = [
        *CHROMIUM_ARGS,
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}%noloop",
    ]
    async with async_playwright() as p:
        context = await p.chromium.launch_persistent_context(
            tempfile.mkdtemp(), executable_path=CHROMIUM, headless=True, args=args
        )
        try:
            yield await context.new_page()
        finally:
            await context.close()


async def two_way_call(page, url: str) -> None:
    await page.goto(url)
    await page.check("#mic")
    await page.evaluate("voicertc.recordLevels()")
    await page.click("#call")
    await wait_for(page, "voicertc.connectionState() === 'connected' && voicertc.channelOpen()")


def events(state: dict, kind: str) -> list[tuple[float, dict]]:
    return [(t, e) for t, e in zip(state["eventTimes"], state["events"], strict=True) if e["type"] == kind]


def first_loud(blocks: list[list[float]], after_ms: float = 0.0) -> float:
    return next(t for t, rms in blocks if t > after_ms and rms > LOUD_RMS)


def last_loud(blocks: list[list[float]]) -> float:
    return max(t for t, rms in blocks if rms > LOUD_RMS)


def check_edges(state: dict, spoken) -> None:
    """Every reported edge sits on the clip's timeline up to one common shift (the call's start)."""
    starts = [e["at_ms"] for _, e in events(state, "user.speech.started")]
    stops = [e["at_ms"] for _, e in events(state, "user.speech.stopped")]
    assert len(starts) == len(stops) == len(spoken), (starts, stops, spoken)
    reported = [*starts, *stops]
    clip = [1000 * s.start_s for s in spoken] + [1000 * s.end_s for s in spoken]
    shifts = np.array(reported) - np.array(clip)
    shift = float(np.median(shifts))
    assert np.all(np.abs(shifts - shift) <= EDGE_MS), f"edges off the clip: {reported} vs {clip}"
    for (_, e), s in zip(events(state, "user.speech.stopped"), spoken, strict=True):
        assert abs(e["duration_ms"] - 1000 * (s.end_s - s.start_s)) <= EDGE_MS


async def test_speech_barge_in_in_chromium(tmp_path):
    pcm, spoken = caller_clip([4.0, QUESTION, 3.0])
    wav = write_wav(tmp_path / "caller.wav", pcm)
    # 150 ms of voice confirm the onset (default 200): the 400 ms also pay the mic capture, Opus both
    # ways, Silero's windows and Chromium's jitter buffer, which grows when a busy host paces late
    with running_server(["--config", str(server_config("speech", min_speech_ms=150))]) as url:
        async with page_with_mic(wav) as page:
            await two_way_call(page, url)
            await page.evaluate(f"voicertc.speak({LONG_REPLY!r})")
            await wait_for(page, "voicertc.state.events.some(e => e.type === 'speech.interrupted')", 30)
            await wait_for(page, "voicertc.state.events.some(e => e.type === 'user.transcript')", 30)
            await page.wait_for_timeout(800)  # the tail: anything still audible after the cut
            levels = await page.evaluate("voicertc.takeLevels()")
            state = await page.evaluate(
                "({events: voicertc.state.events, eventTimes: voicertc.state.eventTimes})"
            )
    cut = events(state, "speech.interrupted")[0][1]
    assert LONG_REPLY.startswith(cut["heard_text"]) and cut["heard_text"], cut
    assert cut["played_ms"] > 1000
    onset = first_loud(levels["mic"])
    quiet = last_loud(levels["heard"])
    print(f"speech barge-in: caller onset -> last loud frame heard {quiet - onset:.0f} ms")
    assert 0 < quiet - onset <= BARGE_IN_MS
    check_edges(state, spoken)
    transcript = events(state, "user.transcript")[0][1]["text"]
    assert wer(QUESTION, transcript) <= 0.2, transcript


async def test_words_barge_in_ignores_the_backchannel_in_chromium(tmp_path):
    pcm, spoken = caller_clip([4.0, BACKCHANNEL, 3.0, QUESTION, 3.0])
    wav = write_wav(tmp_path / "caller.wav", pcm)
    with running_server(["--config", str(server_config("words"))]) as url:
        async with page_with_mic(wav) as page:
            await two_way_call(page, url)
            await page.evaluate(f"voicertc.speak({LONG_REPLY!r})")
            await wait_for(page, "voicertc.state.events.some(e => e.type === 'speech.interrupted')", 40)
            await wait_for(
                page, "voicertc.state.events.filter(e => e.type === 'user.transcript').length >= 2", 30
            )
            state = await page.evaluate(
                "({events: voicertc.state.events, eventTimes: voicertc.state.eventTimes})"
            )
    starts = events(state, "user.speech.started")
    cut_t, cut = events(state, "speech.interrupted")[0]
    assert len(starts) == 2 and cut_t > starts[1][0], "the backchannel cut the reply"
    assert cut["heard_text"] and LONG_REPLY.startswith(cut["heard_text"]), cut
    transcripts = [e["text"] for _, e in events(state, "user.transcript")]
    assert re.sub(r"\W", "", transcripts[0].lower()) in ("okay", "ok"), transcripts
    assert wer(QUESTION, transcripts[1]) <= 0.2, transcripts
    check_edges(state, spoken)
