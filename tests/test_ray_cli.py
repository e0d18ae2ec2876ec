"""`voicertc engine-serve` flags: merged with the config file before validation (no Ray needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from signaling.cli import build_parser, main
from voicertc.errors import ConfigError
from voicertc.remote.cli import engine_serve_config


def parse(*argv: str):
    return build_parser().parse_args(["engine-serve", *argv])


def test_readme_command_model_and_model_dir_are_checked_together(tmp_path, monkeypatch):
    """README: `voicertc engine-serve --model cosyvoice2 --model-dir D` (each flag alone is invalid)."""
    monkeypatch.chdir(tmp_path)  # no ./config.toml: the defaults
    config = engine_serve_config(parse("--model", "cosyvoice2", "--model-dir", "/models/CosyVoice2-0.5B"))
    assert config.engine.backend == "ray"
    assert config.engine.model_name == "cosyvoice2"
    assert config.engine.model_dir == "/models/CosyVoice2-0.5B"


def test_flags_replace_the_config_files_keys_before_validation(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('[engine]\nbackend = "fake"\n[ray]\nnum_replicas = 3\napp_name = "from-file"\n')
    config = engine_serve_config(
        parse("--config", str(path), "--model", "cosyvoice3", "--model-dir", "D", "--replicas", "2")
    )
    assert (config.engine.model_name, config.engine.model_dir) == ("cosyvoice3", "D")
    assert (config.ray.num_replicas, config.ray.app_name) == (2, "from-file")


def test_a_missing_model_dir_is_named_by_its_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"engine\.model_dir: is required for model cosyvoice2"):
        engine_serve_config(parse("--model", "cosyvoice2"))


def test_a_bad_flag_value_fails_before_ray_is_touched(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["engine-serve", "--model", "fake", "--replicas", "0"]) == 2
    assert "ray.num_replicas" in capsys.readouterr().err


def test_metrics_port_needs_local(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["engine-serve", "--model", "fake", "--metrics-port", "9100"]) == 2
    assert "--metrics-port needs --local" in capsys.readouterr().err


def test_a_config_file_section_that_is_not_a_table_is_named(tmp_path):
    path = Path(tmp_path / "config.toml")
    path.write_text('engine = "fake"\n')
    with pytest.raises(ConfigError, match="engine"):
        engine_serve_config(parse("--config", str(path), "--model", "fake"))
