"""Hyper-parameters of the CosyVoice2 flow (`CausalMaskedDiffWithXvec`), read from cosyvoice2.yaml.

Only the values that change tensor shapes or numerics are kept; the variants the official checkpoints
never use (other attention types, conv modules, several UNet levels...) are rejected at load time so a
wrong yaml fails naming the key instead of producing silent garbage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from voicertc.backends.cosyvoice.load.yaml_config import YamlFields
from voicertc.errors import ModelDirError

YAML_NAME = "cosyvoice2.yaml"
FLOW_TAG = "new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec"
ENCODER_TAG = "new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder"
CFM_TAG = "new:cosyvoice.flow.flow_matching.CausalConditionalCFM"
ESTIMATOR_TAG = "new:cosyvoice.flow.decoder.CausalConditionalDecoder"

# Values the official code hard-codes (flow.py / upsample_encoder.py), not read from the yaml.
N_TIMESTEPS = 10
NOISE_FRAMES = 15000  # fixed CFM noise: randn(1, 80, 50 * 300) under seed 0
ENCODER_UPSAMPLE_STRIDE = 2
ENCODER_UP_BLOCKS = 4


@dataclass(frozen=True)
class EncoderConfig:
    """UpsampleConformerEncoder: embed -> pre-lookahead -> conformer -> x2 upsample -> conformer."""

    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    static_chunk_size_tokens: int = 25
    up_blocks: int = ENCODER_UP_BLOCKS


@dataclass(frozen=True)
class EstimatorConfig:
    """CausalConditionalDecoder: the one-level causal UNet that predicts the CFM velocity."""

    in_channels: int = 320
    out_channels: int = 80
    channels: int = 256
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    static_chunk_size_frames: int = 50

    @property
    def time_embed_dim(self) -> int:
        return 4 * self.channels


@dataclass(frozen=True)
class FlowConfig:
    """Everything needed to build `CausalFlow` with the checkpoint's exact layout."""

    vocab_size: int = 6561
    input_size: int = 512
    mel_bins: int = 80
    spk_embed_dim: int = 192
    token_mel_ratio: int = 2
    pre_lookahead_tokens: int = 3
    inference_cfg_rate: float = 0.7
    n_timesteps: int = N_TIMESTEPS
    encoder: EncoderConfig = EncoderConfig()
    estimator: EstimatorConfig = EstimatorConfig()

    @property
    def chunk_tokens(self) -> int:
        """The streaming grid: chunk masks are anchored at the prompt start every this many tokens."""
        return self.encoder.static_chunk_size_tokens

    @classmethod
    def full_size(cls) -> FlowConfig:
        """The official CosyVoice2-0.5B values (cosyvoice.md §4.1)."""
        return cls()

    @classmethod
    def from_yaml(cls, node: dict[str, Any]) -> FlowConfig:
        """Build from the `flow` node of `yaml_config.load_yaml(cosyvoice2.yaml)`."""
        _expect_tag(node, FLOW_TAG, "flow")
        encoder = _sub(node, "encoder", ENCODER_TAG, "flow")
        decoder = _sub(node, "decoder", CFM_TAG, "flow")
        estimator = _sub(decoder, "estimator", ESTIMATOR_TAG, "flow.decoder")
        cfm = _cfm_params(decoder)
        token_mel_ratio = _int(node, "token_mel_ratio", "flow", 2)
        cfg = cls(
            vocab_size=_int(node, "vocab_size", "flow"),
            input_size=_int(node, "input_size", "flow", 512),
            mel_bins=_int(node, "output_size", "flow", 80),
            spk_embed_dim=_int(node, "spk_embed_dim", "flow", 192),
            token_mel_ratio=token_mel_ratio,
            pre_lookahead_tokens=_int(node, "pre_lookahead_len", "flow", 3),
            inference_cfg_rate=float(cfm.get("inference_cfg_rate", 0.7)),
            encoder=_encoder_config(encoder),
            estimator=_estimator_config(estimator),
        )
        _check(cfg, decoder, cfm)
        return cfg


_FIELDS = YamlFields(YAML_NAME)
_where, _expect_tag, _sub, _int, _require = (
    _FIELDS.where,
    _FIELDS.expect_tag,
    _FIELDS.sub,
    _FIELDS.int,
    _FIELDS.require,
)


def _cfm_params(decoder: dict[str, Any]) -> dict[str, Any]:
    params = decoder.get("cfm_params", {})
    if isinstance(params, dict) and "content" in params:
        params = params["content"]
    if not isinstance(params, dict):
        raise ModelDirError(f"{_where('flow.decoder', 'cfm_params')} must be a mapping")
    return params


def _encoder_config(node: dict[str, Any]) -> EncoderConfig:
    path = "flow.encoder"
    for key, allowed, default in (
        ("input_layer", "linear", "conv2d"),
        ("pos_enc_layer_type", "rel_pos_espnet", "rel_pos"),
        ("selfattention_layer_type", "rel_selfattn", "rel_selfattn"),
        ("normalize_before", True, True),
        ("use_cnn_module", False, True),
        ("macaron_style", False, True),
        ("activation_type", "swish", "swish"),
        ("key_bias", True, True),
    ):
        _require(node, key, path, allowed, default)
    return EncoderConfig(
        input_size=_int(node, "input_size", path),
        output_size=_int(node, "output_size", path, 256),
        attention_heads=_int(node, "attention_heads", path, 4),
        linear_units=_int(node, "linear_units", path, 2048),
        num_blocks=_int(node, "num_blocks", path, 6),
        static_chunk_size_tokens=_int(node, "static_chunk_size", path, 0),
    )


def _estimator_config(node: dict[str, Any]) -> EstimatorConfig:
    path = "flow.decoder.estimator"
    channels = node.get("channels", [256, 256])
    if not isinstance(channels, list) or len(channels) != 1:
        raise ModelDirError(f"{_where(path, 'channels')} = {channels!r}: only one UNet level is supported")
    _require(node, "act_fn", path, "gelu", "snake")
    _require(node, "num_decoding_left_chunks", path, -1, 2)
    return EstimatorConfig(
        in_channels=_int(node, "in_channels", path),
        out_channels=_int(node, "out_channels", path),
        channels=int(channels[0]),
        attention_head_dim=_int(node, "attention_head_dim", path, 64),
        n_blocks=_int(node, "n_blocks", path, 1),
        num_mid_blocks=_int(node, "num_mid_blocks", path, 2),
        num_heads=_int(node, "num_heads", path, 4),
        static_chunk_size_frames=_int(node, "static_chunk_size", path, 50),
    )


def _check(cfg: FlowConfig, decoder: dict[str, Any], cfm: dict[str, Any]) -> None:
    _require(cfm, "solver", "flow.decoder.cfm_params", "euler", "euler")
    _require(cfm, "t_scheduler", "flow.decoder.cfm_params", "cosine", "linear")
    if cfg.estimator.in_channels != 4 * cfg.mel_bins:
        raise ModelDirError(
            f"{_where('flow.decoder.estimator', 'in_channels')} = {cfg.estimator.in_channels}: expected "
            f"4 x {cfg.mel_bins} (x, mu, speaker, cond)"
        )
    if _int(decoder, "spk_emb_dim", "flow.decoder", 64) != cfg.mel_bins:
        raise ModelDirError(f"{_where('flow.decoder', 'spk_emb_dim')} must equal flow.output_size")
    chunk_frames = cfg.chunk_tokens * cfg.token_mel_ratio
    if (
        cfg.token_mel_ratio != ENCODER_UPSAMPLE_STRIDE
        or cfg.estimator.static_chunk_size_frames != chunk_frames
    ):
        raise ModelDirError(
            f"{_where('flow.decoder.estimator', 'static_chunk_size')} must be chunk_size x token_mel_ratio "
            f"= {chunk_frames} with token_mel_ratio {ENCODER_UPSAMPLE_STRIDE}"
        )
    if cfg.chunk_tokens < 1:
        raise ModelDirError(f"{_where('flow.encoder', 'static_chunk_size')} must be > 0 for streaming")
