"""Config of the scale-out seam: engine.backend local|ray, engine.model, engine.max_ahead_ms, [ray],
server.public_url; errors name the key; the in-process default never imports Ray."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from voicertc.assemble import create_engine
from voicertc.config import Config, load_config
from voicertc.engine.worker import EngineWorker
from voicertc.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_defaults_keep_the_engine_in_process():
    config = Config()
    assert config.engine.backend == "piper" and not config.engine.remote
    assert config.engine.model == "" and config.engine.model_name == "piper"
    assert config.engine.max_ahead_ms == 2000
    assert config.ray.address == "auto" and config.ray.app_name == "voicertc-engine"
    assert config.ray.auth_mode == "token"
    assert config.server.public_url == ""


def test_local_and_ray_name_the_model_with_engine_model(tmp_path):
    local = load_config(write(tmp_path, '[engine]\nbackend = "local"\nmodel = "fake"\n'))
    assert local.engine.model_name == "fake" and not local.engine.remote
    assert isinstance(create_engine(local), EngineWorker)
    remote = load_config(
        write(
            tmp_path,
            '[engine]\nbackend = "ray"\nmodel = "cosyvoice2"\nmodel_dir = "m"\n'
            '[ray]\naddress = "10.0.0.1:6379"\nnamespace = "tts"\napp_name = "eng"\nnum_gpus = 0.5\n',
        )
    )
    assert remote.engine.remote and remote.engine.model_name == "cosyvoice2"
    assert (remote.ray.address, remote.ray.namespace, remote.ray.app_name) == ("10.0.0.1:6379", "tts", "eng")
    assert remote.ray.num_gpus == 0.5


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[engine]\nbackend = 'remote'\n", "engine.backend"),
        ("[engine]\nbackend = 'ray'\nmodel = 'espeak'\n", "engine.model"),
        ("[engine]\nbackend = 'piper'\nmodel = 'fake'\n", "engine.model"),
        ("[engine]\nbackend = 'ray'\nmodel = 'cosyvoice2'\n", "engine.model_dir"),
        ("[engine]\nmax_ahead_ms = 50\n", "engine.max_ahead_ms"),
        ("[server]\npublic_url = 'front-1:8080'\n", "server.public_url"),
        ("[ray]\naddress = ''\n", "ray.address"),
        ("[ray]\nauth_mode = 'password'\n", "ray.auth_mode"),
        ("[ray]\nnum_replicas = 0\n", "ray.num_replicas"),
        ("[ray]\nmin_replicas = 3\nmax_replicas = 2\n", "ray.max_replicas"),
        ("[ray]\nnum_gpus = -1\n", "ray.num_gpus"),
        ("[ray]\nstall_timeout_s = 0\n", "ray.stall_timeout_s"),
        ("[ray]\nretry_after_s = 0\n", "ray.retry_after_s"),
        ("[ray]\nreplicas = 2\n", "ray.replicas"),
    ],
)
def test_bad_values_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key):
        load_config(write(tmp_path, text))


def test_the_in_process_server_never_imports_ray():
    code = (
        "import sys; from voicertc.config import Config; from voicertc.assemble import create_engine;"
        "import signaling.app, signaling.cli; signaling.cli.build_parser(); create_engine(Config());"
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_engine_serve_flags_override_the_config(tmp_path):
    from signaling.cli import build_parser
    from voicertc.remote.cli import engine_serve_config

    path = write(tmp_path, '[ray]\naddress = "10.0.0.1:6379"\n')
    args = build_parser().parse_args(
        ["engine-serve", "--config", str(path), "--model", "fake", "--replicas", "3", "--num-gpus", "0.25"]
    )
    config = engine_serve_config(args)
    assert config.engine.remote and config.engine.model_name == "fake"
    assert (config.ray.address, config.ray.num_replicas, config.ray.num_gpus) == ("10.0.0.1:6379", 3, 0.25)
    bad = build_parser().parse_args(["engine-serve", "--config", str(path), "--replicas", "0"])
    with pytest.raises(ConfigError, match="ray.num_replicas"):
        engine_serve_config(bad)


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the scale extra")
def test_a_front_end_refuses_to_start_when_the_cluster_is_unreachable(tmp_path):
    path = write(
        tmp_path,
        '[engine]\nbackend = "ray"\n[ray]\naddress = "127.0.0.1:1"\nconnect_timeout_s = 3.0\n'
        'auth_mode = "disabled"\n',
    )
    done = subprocess.run(
        [sys.executable, "-m", "signaling.cli", "serve", "--config", str(path), "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "cannot reach the Ray cluster at '127.0.0.1:1'" in done.stderr
