"""`voicertc serve --engine cosyvoice2 --model-dir DIR` speaks through the browser page (issue 5, done when).

DIR is the tiny speaking directory of `bench.make_tiny_model_dir`, made with the same command as the
README. Its random weights make noise-like audio, so instead of a transcript the test checks that the
page hears sound for as long as the engine spoke: with eos at the minimum length, each normalised piece of
text lasts exactly 2 speech tokens (80 ms) per text token, which the server's `speech.done` must report
and the page's capture must roughly match. Then the call hangs up and the server exits cleanly.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from browser_helpers import (
    CAPTURE_RATE_HZ,
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

from voicertc.backends.cosyvoice.voice.text import TextFrontend

pytestmark = [pytest.mark.browser]

SENTENCE = (
    "Hello world, this is the tiny model speaking. The quick brown fox says hello, "
    "and then it talks for a little longer about the weather, the sea and the mountains."
)  # with the real Qwen2 vocabulary, about 36 text tokens: ~2.9 s at 80 ms per token
CLIP_TEXT = "Good morning. This clip was spoken by the Piper voice, to become a new voice."
MS_PER_TEXT_TOKEN = 2 * 40.0  # eos at the minimum length: 2 speech tokens of 40 ms per text token
WINDOW_SAMPLES = CAPTURE_RATE_HZ // 50  # 20 ms
LOUD_RMS = 0.003  # about -50 dBFS; the capture between utterances is digital silence
MIN_SPEECH_RMS = 0.01


@pytest.fixture(scope="session")
def cv2_speaking_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cv2_speaking") / "cv2_tiny"
    subprocess.run(
        [sys.executable, "-m", "bench.make_tiny_model_dir", str(out)],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="module")
def cv2_server_url(cv2_speaking_dir, tmp_path_factory):
    voices_dir = tmp_path_factory.mktemp("cv2_voices")
    config = write_config(f"[webrtc]\nloopback_only = true\n[engine]\nvoices_dir = {str(voices_dir)!r}\n")
    args = [
        "--config",
        str(config),
        "--engine",
        "cosyvoice2",
        "--model-dir",
        str(cv2_speaking_dir),
        "--port",
        "0",
    ]
    with running_server(args, start_timeout_s=240) as url:  # load, start checks, warm-up (slow when loaded)
        yield url


def expected_audio_ms(model_dir: Path, text: str) -> float:
    """What the engine must say: 80 ms per text token of each normalised piece (the engine's own split)."""
    frontend = TextFrontend(model_dir / "CosyVoice-BlankEN")
    return MS_PER_TEXT_TOKEN * sum(len(frontend.encode(piece)) for piece in frontend.sentences(text))


def window_rms(pcm_16k: np.ndarray) -> np.ndarray:
    """RMS of each whole 20 ms window of the capture."""
    n = len(pcm_16k) // WINDOW_SAMPLES
    return np.sqrt(np.mean(pcm_16k[: n * WINDOW_SAMPLES].reshape(n, WINDOW_SAMPLES) ** 2, axis=1))


async def test_cosyvoice2_speaks_through_the_page(cv2_server_url, cv2_speaking_dir):
    expected_ms = expected_audio_ms(cv2_speaking_dir, SENTENCE)
    assert expected_ms >= 2000.0  # a sentence long enough to tell sound from a click
    async with browser_page() as page:
        await call(page, cv2_server_url)
        await page.evaluate("voicertc.startCapture()")
        await page.evaluate(f"voicertc.speak({SENTENCE!r})")
        await wait_for(page, event_js("speech.done"), timeout_s=120)
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
        assert 0.8 * expected_ms <= sound_ms <= expected_ms + 200.0
        assert np.sqrt(np.mean(loud**2)) > MIN_SPEECH_RMS, "the sound is too faint to be the engine's"
        await hang_up(page)


def piper_clip(path: Path, text: str = CLIP_TEXT) -> Path:
    """A wav of the bundled Piper voice saying `text` (the clip a user would upload)."""
    import soundfile

    from voicertc.backends.piper import PiperBackend

    piper = PiperBackend()
    pcm = np.concatenate(piper.synthesize(text))
    soundfile.write(str(path), pcm, piper.sample_rate_hz)
    return path


async def test_page_registers_a_voice_from_a_piper_clip_and_speaks_with_it(cv2_server_url, tmp_path):
    clip = piper_clip(tmp_path / "piper_clip.wav")
    async with browser_page() as page:
        await page.goto(cv2_server_url)
        await wait_for(page, "document.querySelectorAll('#voice option').length >= 2")  # the picker loaded
        await page.click("#new-voice summary")
        await page.set_input_files("#voice-file", str(clip))
        await page.fill("#voice-transcript", CLIP_TEXT)
        await page.fill("#voice-name", "Piper Clone")
        await page.click("#voice-register")
        await wait_for(page, "document.querySelector('#voice').value === 'piper-clone'", timeout_s=120)
        status = await page.text_content("#voice-status")
        assert "registered (zero_shot" in status, status
        options = await page.eval_on_selector_all("#voice option", "els => els.map(e => e.value)")
        assert "piper-clone" in options

        await page.click("#call")
        await wait_for(page, "voicertc.connectionState() === 'connected' && voicertc.channelOpen()")
        await page.evaluate("voicertc.startCapture()")
        await page.fill("#text", "Hello from a voice made on this page.")
        await page.click("#speak")
        await wait_for(page, event_js("speech.done"), timeout_s=120)
        await asyncio.sleep(0.5)
        assert await page.evaluate(event_js("error")) is None
        done = await page.evaluate(event_js("speech.done"))
        assert done["played_ms"] > 500
        rms = window_rms(await take_capture(page))
        assert (rms > LOUD_RMS).sum() * 20.0 >= 0.5 * done["played_ms"], "the page heard too little"

        bad = await page.evaluate("voicertc.registerVoice(new Blob([new Uint8Array(64)]), 'x', 'junk')")
        assert bad is None
        assert "audio_undecodable" in await page.text_content("#voice-status")
        await hang_up(page)
