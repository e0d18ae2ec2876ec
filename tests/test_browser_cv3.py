"""`voicertc serve --engine cosyvoice3 --model-dir DIR` speaks through the browser page.

DIR is the tiny speaking v3 directory of `bench.make_tiny_model_dir --version 3` (the README's command).
As for CosyVoice2 (`test_browser_cv2.py`), its LLM stops at the minimum length, so each normalised
piece lasts exactly 80 ms per text token: `speech.done` must report that and the page must hear sound
for about that long. Then the call hangs up and the server exits cleanly.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from browser_helpers import (
    REPO,
    browser_page,
    call,
    event_js,
    hang_up,
    running_server,
    take_capture,
    wait_for,
    write_config,
)
from test_browser_cv2 import LOUD_RMS, MIN_SPEECH_RMS, MS_PER_TEXT_TOKEN, SENTENCE, window_rms

from voicertc.backends.cosyvoice.voice.text_v3 import TextFrontendV3

pytestmark = [pytest.mark.browser]


@pytest.fixture(scope="session")
def cv3_speaking_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cv3_speaking") / "cv3_tiny"
    subprocess.run(
        [sys.executable, "-m", "bench.make_tiny_model_dir", "--version", "3", str(out)],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="module")
def cv3_server_url(cv3_speaking_dir, tmp_path_factory):
    voices_dir = tmp_path_factory.mktemp("cv3_voices")
    config = write_config(f"[webrtc]\nloopback_only = true\n[engine]\nvoices_dir = {str(voices_dir)!r}\n")
    args = [
        "--config",
        str(config),
        "--engine",
        "cosyvoice3",
        "--model-dir",
        str(cv3_speaking_dir),
        "--port",
        "0",
    ]
    with running_server(args, start_timeout_s=240.0) as url:  # a loaded host: model load + warm-up
        yield url


def expected_audio_ms(model_dir: Path, text: str) -> float:
    frontend = TextFrontendV3(model_dir / "CosyVoice-BlankEN")
    return MS_PER_TEXT_TOKEN * sum(len(frontend.encode(piece)) for piece in frontend.sentences(text))


async def test_cosyvoice3_speaks_through_the_page(cv3_server_url, cv3_speaking_dir):
    expected_ms = expected_audio_ms(cv3_speaking_dir, SENTENCE)
    assert expected_ms >= 2000.0
    async with browser_page() as page:
        await call(page, cv3_server_url)
        await page.evaluate("voicertc.startCapture()")
        await page.evaluate(f"voicertc.speak({SENTENCE!r})")
        await wait_for(page, event_js("speech.done"), timeout_s=60)
        await asyncio.sleep(0.5)  # the tail in the jitter buffer
        heard = await take_capture(page)
        done = await page.evaluate(event_js("speech.done"))
        started = await page.evaluate(event_js("speech.started"))
        assert started is not None and started["ttfa_ms"] > 0
        assert await page.evaluate(event_js("error")) is None
        assert done["played_ms"] == pytest.approx(expected_ms, abs=25.0)
        rms = window_rms(heard)
        loud = rms[rms > LOUD_RMS]
        sound_ms = 20.0 * len(loud)
        print(f"engine {expected_ms:.0f} ms, played {done['played_ms']:.0f} ms, page heard {sound_ms:.0f} ms")
        # the page may hear a little more than was played: under host load Chromium's jitter buffer
        # stretches the audio (seen: +240 ms on 8.3 s with load average 15 on 2 cores)
        assert 0.8 * expected_ms <= sound_ms <= 1.05 * expected_ms + 200.0
        assert np.sqrt(np.mean(loud**2)) > MIN_SPEECH_RMS, "the sound is too faint to be the engine's"
        await hang_up(page)
