"""Import boundaries: the engine knows no transport; the transport knows no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


def imported_after(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return {name.split(".")[0] for name in out.split()}


def test_engine_does_not_import_aiortc_or_aiohttp():
    mods = imported_after("voicertc.engine")
    assert not {"aiortc", "aiohttp", "torch"} & mods


def test_engine_worker_and_fake_stay_transport_free():
    mods = imported_after("voicertc.engine.fake")
    assert not {"aiortc", "aiohttp", "torch"} & mods


@pytest.mark.parametrize("module", ["voicertc.webrtc", "voicertc.audio", "signaling.app"])
def test_transport_does_not_import_torch(module):
    assert "torch" not in imported_after(module)
