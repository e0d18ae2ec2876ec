"""CosyVoice3 flow (`CausalMaskedDiffWithDiT`): speech tokens (25 Hz) -> 80-bin log-mel (50 Hz).

Everything but the token encoder and the estimator is CosyVoice2's `CausalFlow` (whole-prefix
`infer`, incremental `init_stream` / `stream_step(_batch)`, fixed CFM noise by absolute frame, the
Euler/CFG solver, per-step estimator caches). What differs:
* mu = repeat_interleave(PreLookaheadLayer(embed(tokens)), 2): no conformer, no projection; the
  lookahead conv keeps its 2 activation frames of left context in `EncoderCache.lookahead_tail`;
* the estimator is a `DiT` with a 50-frame chunk mask (`flow_dit.py`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor, nn

from voicertc.backends.cosyvoice.flow.cfm import CausalConditionalCFM
from voicertc.backends.cosyvoice.flow.config_v3 import YAML_NAME, FlowV3Config
from voicertc.backends.cosyvoice.flow.dit import DiT
from voicertc.backends.cosyvoice.flow.encoder import EncoderCache, PreLookaheadLayer
from voicertc.backends.cosyvoice.flow.flow import CausalFlow, _Chunk
from voicertc.backends.cosyvoice.load.checkpoint import check_layout
from voicertc.backends.cosyvoice.load.yaml_config import load_yaml
from voicertc.errors import ModelDirError

logger = logging.getLogger(__name__)

FLOW_WEIGHTS_NAME = "flow.pt"


class CausalFlowV3(CausalFlow):
    """Checkpoint-compatible flow: `state_dict()` keys and shapes equal the official v3 `flow.pt`."""

    cfg: FlowV3Config  # type: ignore[assignment]

    def __init__(self, cfg: FlowV3Config) -> None:  # noqa: D107 - the parent's modules differ
        nn.Module.__init__(self)
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.mel_bins)
        self.pre_lookahead_layer = PreLookaheadLayer(
            cfg.input_size, cfg.pre_lookahead_tokens, channels=cfg.lookahead_channels
        )
        self.decoder = CausalConditionalCFM(
            None, cfg.n_timesteps, cfg.inference_cfg_rate, estimator=DiT(cfg.estimator)
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu") -> CausalFlowV3:
        """Build from `cosyvoice3.yaml` and load `flow.pt` strictly, as the official loader does."""
        model_dir = Path(model_dir)
        flow = cls(FlowV3Config.from_yaml(load_yaml(model_dir / YAML_NAME).get("flow", {})))
        path = model_dir / FLOW_WEIGHTS_NAME
        try:
            weights = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError) as exc:
            raise ModelDirError(f"{path}: cannot load ({exc})") from exc
        load_flow_v3_state_dict(flow, weights, str(path))
        return flow.to(device).eval()

    encodes_rows = False  # no conformer: its encode is one conv per utterance

    def _new_encoder_cache(self, reserve_tokens: int) -> EncoderCache:
        return EncoderCache()  # only the lookahead conv's tail and the token count are used

    def lookahead(self, tokens: Tensor, context: Tensor | None, cache: EncoderCache) -> Tensor:
        """PreLookaheadLayer(embed(tokens)) [1, T, 80] for new tokens [1, T] (+ lookahead context)."""
        emb = self.input_embedding(tokens)
        context_emb = self.input_embedding(context) if context is not None else None
        h = self.pre_lookahead_layer(emb, context_emb, cache)
        cache.tokens += tokens.shape[1]
        return h

    def _encode(self, chunk: _Chunk, chunk_masks: bool) -> Tensor:
        # -> mu [1, 80, 2T] for the chunk's tokens
        h = self.lookahead(chunk.tokens, chunk.context, chunk.state.encoder)
        return h.repeat_interleave(self.cfg.token_mel_ratio, dim=1).transpose(1, 2)


def load_flow_v3_state_dict(module: CausalFlowV3, state_dict: dict[str, Tensor], source_name: str) -> None:
    """Strict load with an error that names the offending keys / shapes and the file."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    check_layout(state_dict, expected, source_name, f"flow built from {YAML_NAME}")
    module.load_state_dict(state_dict, strict=True)
    logger.debug("loaded v3 flow weights from %s (%d tensors)", source_name, len(state_dict))
