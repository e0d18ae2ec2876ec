"""config.toml -> typed config: defaults, the shipped file, errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from voicertc.config import Config, load_config
from voicertc.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_shipped_config_equals_the_defaults():
    assert load_config(REPO / "config.toml") == Config()


def test_values_are_read_and_typed(tmp_path):
    cfg = load_config(
        write(tmp_path, '[server]\nport = 9000\n[auth]\ntokens = ["a", "b"]\n[fake]\nrtf = 1\n')
    )
    assert cfg.server.port == 9000
    assert cfg.auth.tokens == ("a", "b")
    assert cfg.fake.rtf == 1.0 and isinstance(cfg.fake.rtf, float)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[server]\nprot = 1\n", "server.prot"),
        ("[sever]\nport = 1\n", "sever"),
        ("[server]\nport = 'x'\n", "server.port"),
        ("[server]\nport = 70000\n", "server.port"),
        ("[webrtc]\nframe_ms = 40\n", "webrtc.frame_ms"),
        ("[engine]\nbackend = 'espeak'\n", "engine.backend"),
        ("[engine]\nbackend = 'cosyvoice2'\n", "engine.model_dir"),
        ("[engine]\nworkers = 0\n", "engine.workers"),
        ("[engine]\nmax_batch = 0\n", "engine.max_batch"),
        ("[engine]\nbistream_unit = 'phrase'\n", "engine.bistream_unit"),
        ("[engine]\nbackend = 'cosyvoice3'\nmodel_dir = 'm'\ndit_conv = 'fft'\n", "engine.dit_conv"),
        ("[engine]\nbackend = 'cosyvoice2'\nmodel_dir = 'm'\ndit_conv = 'matmul'\n", "engine.dit_conv"),
        ("[engine]\nbackend = 'cosyvoice2'\nmodel_dir = 'm'\nworkers = 2\n", "engine.workers"),
        ("[engine]\nbackend = 'cosyvoice3'\n", "engine.model_dir"),
        ("[engine]\nbackend = 'cosyvoice3'\nmodel_dir = 'm'\nworkers = 2\n", "engine.workers"),
        ("[schedule]\nmax_hop_tokens = 10\n", "schedule.max_hop_tokens"),
        ("[schedule]\ngrid_tokens = -25\n", "schedule.grid_tokens"),
        ("[schedule]\nfinal_chunk = 'full'\n", "schedule.final_chunk"),
        ("[webrtc]\ntrim_leading_silence_ms = -1\n", "webrtc.trim_leading_silence_ms"),
        ("[auth]\ntokens = [1]\n", "auth.tokens"),
        ("[server]\nuse_uvloop = 1\n", "server.use_uvloop"),
        ("[engine]\nload_in_background = 'yes'\n", "engine.load_in_background"),
        ("[limits]\nvoice_min_s = 0.1\n", "limits.voice_min_s"),
        ("[limits]\nvoice_max_s = 31\n", "limits.voice_max_s"),
        ("[limits]\nvoice_min_s = 5\nvoice_max_s = 2\n", "limits.voice_max_s"),
        ("[limits]\nvoice_max_bytes = 10\n", "limits.voice_max_bytes"),
        ("[engine]\nmax_step_ms = 5\n", "engine.max_step_ms"),
        ("[engine]\nmax_step_ms = 2.5\n", "engine.max_step_ms"),
        ("[engine]\npiper_piece_phonemes = 3\n", "engine.piper_piece_phonemes"),
        ("[engine]\npiper_piece_phonemes = -1\n", "engine.piper_piece_phonemes"),
        ("[limits]\nmax_utterance_s = 0\n", "limits.max_utterance_s"),
        ("[limits]\nmax_utterance_s = 'long'\n", "limits.max_utterance_s"),
    ],
)
def test_bad_values_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(write(tmp_path, text))


def test_bad_toml_and_missing_file_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[server\n"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")


def test_replace_validates_overrides():
    cfg = Config().replace("server", port=1234)
    assert cfg.server.port == 1234 and cfg.server.host == "127.0.0.1"
    with pytest.raises(ConfigError, match="engine.backend"):
        Config().replace("engine", backend="nope")


def test_every_shipped_key_has_a_comment():
    for line in (REPO / "config.toml").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            assert "#" in line, f"config.toml line without a comment: {line!r}"


def test_step_and_utterance_bounds_are_read(tmp_path):
    text = "[engine]\nmax_step_ms = 150\npiper_piece_phonemes = 60\n[limits]\nmax_utterance_s = 30\n"
    cfg = load_config(write(tmp_path, text))
    assert (cfg.engine.max_step_ms, cfg.engine.piper_piece_phonemes) == (150, 60)
    assert cfg.limits.max_utterance_s == 30.0
    assert (Config().engine.max_step_ms, Config().limits.max_utterance_s) == (200, 120.0)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[engine]\nestimator = 'trt'\n", "engine.estimator"),
        ("[engine]\nllm = 'sglang'\n", "engine.llm"),
        ("[engine]\ncompile = 'yes'\n", "engine.compile"),
        ("[engine]\naccel_dir = 3\n", "engine.accel_dir"),
    ],
)
def test_bad_acceleration_values_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ("estimator = 'onnx'", "engine.estimator"),
        ("llm = 'vllm'", "engine.llm"),
        ("compile = true", "engine.compile"),
    ],
)
def test_cosyvoice2_only_acceleration_is_refused_for_cosyvoice3(tmp_path, setting, key):
    text = f"[engine]\nbackend = 'cosyvoice3'\nmodel_dir = '/m'\n{setting}\n"
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}.*cosyvoice3"):
        load_config(write(tmp_path, text))
    load_config(write(tmp_path, text.replace("cosyvoice3", "cosyvoice2")))  # CosyVoice2 takes it


def test_cosyvoice3_compiles_only_its_captured_decode_step(tmp_path):
    text = "[engine]\nbackend = 'cosyvoice3'\nmodel_dir = '/m'\ndevice = 'cuda'\ncompile = true\n"
    with pytest.raises(ConfigError, match=r"engine[.]compile.*cuda_graphs"):
        load_config(write(tmp_path, text))
    engine = load_config(write(tmp_path, text + "cuda_graphs = true\n")).engine
    assert engine.compile and engine.cuda_graphs


def test_acceleration_defaults_are_exact_fp32_eager():
    engine = Config().engine
    paths = (engine.dtype, engine.estimator, engine.compile, engine.llm)
    assert paths == ("float32", "torch", False, "torch")
    assert load_config(REPO / "config.toml").engine.accel_dir == ""
