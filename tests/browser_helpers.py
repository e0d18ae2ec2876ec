"""What the browser tests share: `voicertc serve` as a subprocess, Debian's Chromium, the page's capture.

Playwright drives /usr/bin/chromium (never a downloaded browser); the page (web/app.js) exposes
`window.voicertc` with its events and a 16 kHz WebAudio capture of what it receives.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np

from bench.peer import CHROMIUM, CHROMIUM_ARGS

REPO = Path(__file__).resolve().parents[1]
CAPTURE_RATE_HZ = 16000


@contextlib.contextmanager
def running_server(args: list[str], start_timeout_s: float = 60.0) -> Iterator[str]:
    """`voicertc serve ARGS` (from the repo, offline) until the block ends; yields its URL.

    Its output is drained on a thread (a full pipe would stall the server) and shown when it fails to
    start or to exit cleanly; at the end it gets SIGTERM and must exit with status 0.
    """
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "signaling.cli", "serve", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    started = threading.Event()
    url: list[str] = []

    def drain() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            match = re.search(r"serving on (http://\S+)", line)
            if match and not url:
                url.append(match.group(1))
                started.set()
        started.set()  # exited before serving

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        started.wait(start_timeout_s)
        assert url, "server did not start:\n" + "".join(lines)
        yield url[0]
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    assert proc.returncode == 0, f"server exited with {proc.returncode}:\n" + "".join(lines[-40:])


def write_config(text: str) -> Path:
    """A throwaway config.toml with `text`."""
    config = Path(tempfile.mkdtemp()) / "config.toml"
    config.write_text(text)
    return config


@contextlib.asynccontextmanager
async def browser_page() -> AsyncIterator[object]:
    """A fresh page in headless Debian Chromium (own profile), closed at the end."""
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        context = await p.chromium.launch_persistent_context(
            tempfile.mkdtemp(), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield await context.new_page()
        finally:
            await context.close()


async def wait_for(page, expression: str, timeout_s: float = 15.0) -> None:
    await page.wait_for_function(expression, timeout=timeout_s * 1000)


async def take_capture(page) -> np.ndarray:
    return np.clip(np.asarray(await page.evaluate("voicertc.takeCapture()"), dtype=np.float32), -1.0, 1.0)


def event_js(kind: str) -> str:
    return f"voicertc.state.events.find(e => e.type === '{kind}')"


async def call(page, url: str) -> None:
    """Open the page and place a call; returns once media and the data channel are up."""
    await page.goto(url)
    await page.click("#call")
    await wait_for(page, "voicertc.connectionState() === 'connected' && voicertc.channelOpen()")


async def hang_up(page) -> None:
    await page.click("#hangup")
    await wait_for(page, "voicertc.connectionState() === 'idle'")
