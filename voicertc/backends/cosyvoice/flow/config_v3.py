"""Hyper-parameters of the CosyVoice3 flow (`CausalMaskedDiffWithDiT`), read from cosyvoice3.yaml.

Unlike CosyVoice2 there is no conformer encoder: the 80-dim token embedding plus the PreLookaheadLayer
residual, repeated twice per token, is the CFM condition mu; the velocity estimator is a DiT. Variants
the released checkpoint never uses (long skip connection, limited left chunks, other solvers) are
rejected at load time naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from voicertc.backends.cosyvoice.flow.config import N_TIMESTEPS
from voicertc.backends.cosyvoice.load.yaml_config import YamlFields
from voicertc.errors import ModelDirError

YAML_NAME = "cosyvoice3.yaml"
FLOW_TAG = "new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT"
LOOKAHEAD_TAG = "new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer"
CFM_TAG = "new:cosyvoice.flow.flow_matching.CausalConditionalCFM"
DIT_TAG = "new:cosyvoice.flow.DiT.dit.DiT"
CONV_POS_KERNEL = 31  # CausalConvPositionEmbedding defaults (hard-coded upstream)
CONV_POS_GROUPS = 16
TIME_FREQ_DIM = 256  # TimestepEmbedding(dim, freq_embed_dim=256)


@dataclass(frozen=True)
class DitConfig:
    """The DiT velocity estimator (AdaLN-zero blocks, rotary on the first head, causal conv pos-embed)."""

    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: int = 2
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    static_chunk_size_frames: int = 50

    @property
    def in_dim(self) -> int:
        return 2 * self.mel_dim + self.mu_dim + self.spk_dim


@dataclass(frozen=True)
class FlowV3Config:
    """Everything needed to build `CausalFlowV3` with the checkpoint's exact layout.

    The names `CausalFlow` (CosyVoice2) reads are kept: `chunk_tokens`, `pre_lookahead_tokens`, ..."""

    vocab_size: int = 6561
    input_size: int = 80
    mel_bins: int = 80
    spk_embed_dim: int = 192
    token_mel_ratio: int = 2
    pre_lookahead_tokens: int = 3
    lookahead_channels: int = 1024
    inference_cfg_rate: float = 0.7
    n_timesteps: int = N_TIMESTEPS
    estimator: DitConfig = field(default_factory=DitConfig)

    @property
    def chunk_tokens(self) -> int:
        """The streaming grid in tokens: the DiT chunk mask is anchored at the prompt start."""
        return self.estimator.static_chunk_size_frames // self.token_mel_ratio

    @classmethod
    def full_size(cls) -> FlowV3Config:
        """The official Fun-CosyVoice3-0.5B values."""
        return cls()

    @classmethod
    def from_yaml(cls, node: dict[str, Any]) -> FlowV3Config:
        """Build from the `flow` node of `yaml_config.load_yaml(cosyvoice3.yaml)`."""
        _expect_tag(node, FLOW_TAG, "flow")
        look = _sub(node, "pre_lookahead_layer", LOOKAHEAD_TAG, "flow")
        decoder = _sub(node, "decoder", CFM_TAG, "flow")
        dit = _sub(decoder, "estimator", DIT_TAG, "flow.decoder")
        cfm = decoder.get("cfm_params", {})
        cfm = cfm.get("content", cfm) if isinstance(cfm, dict) else cfm
        if not isinstance(cfm, dict):
            raise ModelDirError(f"{YAML_NAME}: flow.decoder.cfm_params must be a mapping")
        path = "flow.decoder.estimator"
        estimator = DitConfig(
            dim=_int(dit, "dim", path),
            depth=_int(dit, "depth", path, 8),
            heads=_int(dit, "heads", path, 8),
            dim_head=_int(dit, "dim_head", path, 64),
            ff_mult=_int(dit, "ff_mult", path, 4),
            mel_dim=_int(dit, "mel_dim", path, 100),
            mu_dim=_int(dit, "mu_dim", path, _int(dit, "mel_dim", path, 100)),
            spk_dim=_int(dit, "spk_dim", path, 0),
            static_chunk_size_frames=_int(dit, "static_chunk_size", path, 50),
        )
        cfg = cls(
            vocab_size=_int(node, "vocab_size", "flow"),
            input_size=_int(node, "input_size", "flow", 512),
            mel_bins=_int(node, "output_size", "flow", 80),
            spk_embed_dim=_int(node, "spk_embed_dim", "flow", 192),
            token_mel_ratio=_int(node, "token_mel_ratio", "flow", 2),
            pre_lookahead_tokens=_int(node, "pre_lookahead_len", "flow", 3),
            lookahead_channels=_int(look, "channels", "flow.pre_lookahead_layer"),
            inference_cfg_rate=float(cfm.get("inference_cfg_rate", 0.7)),
            estimator=estimator,
        )
        _check(cfg, node, look, decoder, dit, cfm)
        return cfg


_FIELDS = YamlFields(YAML_NAME)
_where, _expect_tag, _sub, _int, _require = (
    _FIELDS.where,
    _FIELDS.expect_tag,
    _FIELDS.sub,
    _FIELDS.int,
    _FIELDS.require,
)


def _check(
    cfg: FlowV3Config,
    node: dict[str, Any],
    look: dict[str, Any],
    decoder: dict[str, Any],
    dit: dict[str, Any],
    cfm: dict[str, Any],
) -> None:
    est = cfg.estimator
    _require(cfm, "solver", "flow.decoder.cfm_params", "euler", "euler")
    _require(cfm, "t_scheduler", "flow.decoder.cfm_params", "cosine", "linear")
    _require(dit, "long_skip_connection", "flow.decoder.estimator", False, False)
    _require(dit, "num_decoding_left_chunks", "flow.decoder.estimator", -1, 2)
    if _int(look, "in_channels", "flow.pre_lookahead_layer") != cfg.input_size:
        raise ModelDirError(f"{_where('flow.pre_lookahead_layer', 'in_channels')} must equal flow.input_size")
    if _int(look, "pre_lookahead_len", "flow.pre_lookahead_layer", 1) != cfg.pre_lookahead_tokens:
        raise ModelDirError(
            f"{_where('flow.pre_lookahead_layer', 'pre_lookahead_len')} != flow.pre_lookahead_len"
        )
    if est.mu_dim != cfg.input_size or est.mel_dim != cfg.mel_bins or est.spk_dim != cfg.mel_bins:
        raise ModelDirError(
            f"{YAML_NAME}: flow.decoder.estimator mu_dim / mel_dim / spk_dim must be "
            f"{cfg.input_size} / {cfg.mel_bins} / {cfg.mel_bins}"
        )
    if _int(dit, "out_channels", "flow.decoder.estimator", est.mel_dim) != est.mel_dim:
        raise ModelDirError(f"{_where('flow.decoder.estimator', 'out_channels')} must equal mel_dim")
    if _int(decoder, "spk_emb_dim", "flow.decoder", cfg.mel_bins) != cfg.mel_bins:
        raise ModelDirError(f"{_where('flow.decoder', 'spk_emb_dim')} must equal flow.output_size")
    if est.dim % CONV_POS_GROUPS:
        raise ModelDirError(
            f"{_where('flow.decoder.estimator', 'dim')} must be a multiple of {CONV_POS_GROUPS}"
        )
    if est.static_chunk_size_frames % cfg.token_mel_ratio or cfg.chunk_tokens < 1:
        raise ModelDirError(
            f"{_where('flow.decoder.estimator', 'static_chunk_size')} must be a positive multiple of "
            f"token_mel_ratio ({cfg.token_mel_ratio})"
        )
    if node.get("output_type", "mel") != "mel":
        raise ModelDirError(f"{_where('flow', 'output_type')} must be 'mel'")
