"""The CosyVoice2 speech-token LLM (`Qwen2LM`): a Qwen2 backbone reading text ids, writing speech ids.

Module names mirror the official `Qwen2LM`, so `llm.pt` loads strictly: `llm.model.*` is transformers'
`Qwen2ForCausalLM` built from `CosyVoice-BlankEN/config.json` (its `lm_head` is tied to the text
embedding and never used), `llm_embedding` [2, H] holds sos (row 0) and task_id (row 1),
`speech_embedding` [6564, H] and `llm_decoder` Linear(H, 6564, bias) are the speech side.

Decoding is step-able for the engine thread: `prefill` builds an `LlmSession` (KV cache, decoded tokens)
and `step(session)` yields one speech token per call; `generate` is just that loop.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.cache_utils import DynamicCache

from voicertc.backends.cosyvoice.llm.kv import KVSlot, SlotKV
from voicertc.backends.cosyvoice.llm.sampling import (
    SamplingMode,
    SamplingParams,
    sample_token,
)
from voicertc.backends.cosyvoice.load.checkpoint import check_layout
from voicertc.engine.parts import Parts, run_to_end
from voicertc.errors import ModelDirError

logger = logging.getLogger(__name__)

SPEECH_TOKEN_SIZE = 6561  # FSQ speech vocabulary: ids 0..6560
EOS_ID = SPEECH_TOKEN_SIZE  # 6561
FILL_ID = SPEECH_TOKEN_SIZE + 2  # 6563, bistream "give me more text"
STOP_IDS = frozenset({SPEECH_TOKEN_SIZE, SPEECH_TOKEN_SIZE + 1, SPEECH_TOKEN_SIZE + 2})
SOS_ROW, TASK_ID_ROW = 0, 1
MIN_TOKEN_TEXT_RATIO, MAX_TOKEN_TEXT_RATIO = 2, 20
QWEN2LM_TAG = "new:cosyvoice.llm.llm.Qwen2LM"


@dataclass(frozen=True)
class LlmConfig:
    """Hyperparameters of `Qwen2LM`: the yaml `llm` node plus the backbone's `config.json`."""

    qwen2: dict[str, Any]
    input_size: int = 896
    output_size: int = 896
    speech_token_size: int = SPEECH_TOKEN_SIZE
    mix_ratio: tuple[int, int] = (5, 15)
    sampling: SamplingParams = field(default_factory=SamplingParams)

    @classmethod
    def from_yaml(cls, node: dict[str, Any], qwen2_config_path: str | Path) -> LlmConfig:
        path = Path(qwen2_config_path)
        try:
            qwen2 = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ModelDirError(f"{path}: cannot read the Qwen2 backbone config ({exc})") from exc
        except json.JSONDecodeError as exc:
            raise ModelDirError(f"{path}: not valid JSON ({exc})") from exc
        try:
            cfg = cls(
                qwen2=qwen2,
                input_size=int(node["llm_input_size"]),
                output_size=int(node["llm_output_size"]),
                speech_token_size=int(node.get("speech_token_size", SPEECH_TOKEN_SIZE)),
                mix_ratio=tuple(int(x) for x in node.get("mix_ratio", (5, 15))),  # type: ignore[arg-type]
                sampling=SamplingParams.from_yaml(node.get("sampling")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelDirError(f"cosyvoice2.yaml: bad llm node ({exc!r})") from exc
        if cfg.speech_token_size != SPEECH_TOKEN_SIZE:
            raise ModelDirError(
                f"cosyvoice2.yaml: llm.speech_token_size {cfg.speech_token_size}, expected 6561"
            )
        if qwen2.get("hidden_size") != cfg.input_size:
            raise ModelDirError(
                f"{path}: hidden_size {qwen2.get('hidden_size')} != yaml llm_input_size {cfg.input_size}"
            )
        return cfg


def qwen2_config(values: dict[str, Any]) -> Qwen2Config:
    """A transformers Qwen2Config from a config.json dict, with SDPA attention (the golden run's)."""
    cfg = Qwen2Config(
        **{k: v for k, v in values.items() if k not in ("architectures", "transformers_version")}
    )
    cfg._attn_implementation = "sdpa"
    return cfg


class Qwen2Encoder(nn.Module):
    """Holds the HF model under `.model`, so its keys read `llm.model.model.*` like the official ones."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2ForCausalLM(config)

    @property
    def text_embedding(self) -> nn.Embedding:
        return self.model.model.embed_tokens

    def forward(self, embeds: Tensor, cache: DynamicCache | None = None) -> Tensor:
        # embeds: [B, T, H] -> hidden: [B, T, H] (after the final RMSNorm); cache is extended in place
        out = self.model.model(inputs_embeds=embeds, past_key_values=cache, use_cache=cache is not None)
        return out.last_hidden_state


@dataclass
class LlmSession:
    """Decoding state of one utterance. Owned by the engine thread; only `Qwen2LM.step` mutates it.

    Invariant: the cache holds every input fed so far; `pending` [1, T, H] is the input not yet fed
    (the whole prompt before the first step, then the embedding of the last emitted token).
    """

    cache: DynamicCache | KVSlot
    pending: Tensor | None
    min_len: int
    max_len: int
    sampling: SamplingMode = "ras"
    generator: torch.Generator | None = None
    out_tokens: list[int] = field(default_factory=list)
    finished: bool = False
    logits: Tensor | None = None  # [V] raw llm_decoder output of the last step
    unread: int = 0  # steps launched ahead whose tokens are not read yet (`llm.ahead`; 0 or 1)

    @property
    def step_index(self) -> int:
        return len(self.out_tokens)


@dataclass
class PrefixCache:
    """KV cache of [sos, embed(prompt_text)], the only part of the input a voice can share."""

    prompt_text_tokens: tuple[int, ...]
    cache: DynamicCache


class Qwen2LM(nn.Module):
    """The official `Qwen2LM` state-dict layout with step-able inference."""

    stop_ids: frozenset[int] = STOP_IDS  # a sampled id in here ends the utterance
    min_len_ban_ids: tuple[int, ...] = (EOS_ID,)  # masked while fewer than min_len tokens are out

    def __init__(self, config: LlmConfig) -> None:
        super().__init__()
        self.config = config
        self.sampling_params = config.sampling
        self.llm_embedding = nn.Embedding(2, config.input_size)
        self.llm = Qwen2Encoder(qwen2_config(config.qwen2))
        self.llm_decoder = nn.Linear(config.output_size, config.speech_token_size + 3)
        self.speech_embedding = nn.Embedding(config.speech_token_size + 3, config.input_size)

    @property
    def text_vocab_size(self) -> int:
        return self.llm.text_embedding.num_embeddings

    # ---- input assembly -------------------------------------------------------------------------

    def _ids(self, tokens: Sequence[int] | Tensor, what: str, upper: int) -> Tensor:
        ids = torch.as_tensor(tokens if isinstance(tokens, Tensor) else list(tokens), dtype=torch.long)
        ids = ids.reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= upper):
            bad = ids[(ids < 0) | (ids >= upper)][0].item()
            raise ValueError(f"{what} id {bad} is outside the vocabulary [0, {upper})")
        return ids.to(self.llm_decoder.weight.device)

    def check_text_ids(self, tokens: Sequence[int] | Tensor) -> list[int]:
        """The ids as ints; ValueError for any id outside the text vocabulary."""
        return [int(t) for t in self._ids(tokens, "text token", self.text_vocab_size).tolist()]

    def check_speech_ids(self, tokens: Sequence[int] | Tensor) -> list[int]:
        """The ids as ints; ValueError for any id outside [0, 6561)."""
        return [int(t) for t in self._ids(tokens, "speech token", self.config.speech_token_size).tolist()]

    def embed_text(self, tokens: Sequence[int] | Tensor) -> Tensor:
        # tokens: [T] text ids -> [1, T, H]
        ids = self._ids(tokens, "text token", self.text_vocab_size)
        return self.llm.text_embedding(ids)[None]

    def embed_speech(self, tokens: Sequence[int] | Tensor) -> Tensor:
        # tokens: [T] speech ids in [0, 6561) -> [1, T, H]
        ids = self._ids(tokens, "speech token", self.config.speech_token_size)
        return self.speech_embedding(ids)[None]

    def special_embedding(self, row: int) -> Tensor:
        return self.llm_embedding.weight[row].reshape(1, 1, -1)

    def lm_input(
        self,
        text_tokens: Sequence[int] | Tensor,
        prompt_text_tokens: Sequence[int] | Tensor = (),
        prompt_speech_tokens: Sequence[int] | Tensor = (),
    ) -> Tensor:
        """[sos, embed(prompt_text ⧺ text), task_id, speech_embedding(prompt_speech)] as [1, T, H]."""
        return torch.cat(
            [
                self.special_embedding(SOS_ROW),
                self.embed_text(prompt_text_tokens),
                self.embed_text(text_tokens),
                self.special_embedding(TASK_ID_ROW),
                self.embed_speech(prompt_speech_tokens),
            ],
            dim=1,
        )

    # ---- teacher-forced ---------------------------------------------------------------------------

    @torch.inference_mode()
    def logits(
        self,
        text_tokens: Sequence[int] | Tensor,
        prompt_text_tokens: Sequence[int] | Tensor = (),
        prompt_speech_tokens: Sequence[int] | Tensor = (),
    ) -> Tensor:
        """Raw llm_decoder outputs [1, T, 6564] over the whole assembled input, in one forward."""
        hidden = self.llm(self.lm_input(text_tokens, prompt_text_tokens, prompt_speech_tokens))
        return self.llm_decoder(hidden)

    # ---- step-able decoding -----------------------------------------------------------------------

    @torch.inference_mode()
    def prefix_cache(self, prompt_text_tokens: Sequence[int] | Tensor) -> PrefixCache:
        """Run [sos, prompt_text] once so that every utterance of a voice can start from a copy."""
        return run_to_end(self.prefix_cache_parts(prompt_text_tokens))

    def prefix_cache_parts(self, prompt_text_tokens: Sequence[int] | Tensor) -> Parts[PrefixCache]:
        """`prefix_cache` in bounded parts: [sos, prompt_text] through the backbone a decoder layer per
        part (`SlotKV.forward_parts` on a private one-row pool: a 400-token transcript was 1.7 s in one
        forward on the full-size model on a CPU, and feeding it in chunks of positions re-reads every
        weight per chunk), its K/V then held as the `DynamicCache` a session copies. The ids are checked
        now (ValueError), before any part; run each part under `torch.inference_mode()`."""
        ids = tuple(
            int(t) for t in self._ids(prompt_text_tokens, "text token", self.text_vocab_size).tolist()
        )
        return self._prefix_parts(ids)

    def _prefix_parts(self, ids: tuple[int, ...]) -> Parts[PrefixCache]:
        embeds = torch.cat([self.special_embedding(SOS_ROW), self.embed_text(ids)], dim=1)
        length = embeds.shape[1]
        pool = SlotKV(self.llm.model.model, slots=1, capacity=length)
        row = pool.acquire()
        yield from pool.forward_parts([row], embeds)
        cache = DynamicCache()
        for layer in range(pool.layers):
            keys = pool.keys[layer][row.index, :, :length].unsqueeze(0).clone()
            values = pool.values[layer][row.index, :, :length].unsqueeze(0).clone()
            cache.update(keys, values, layer)
        return PrefixCache(prompt_text_tokens=ids, cache=cache)

    @torch.inference_mode()
    def prefill(
        self,
        text_tokens: Sequence[int] | Tensor,
        prompt_text_tokens: Sequence[int] | Tensor = (),
        prompt_speech_tokens: Sequence[int] | Tensor = (),
        *,
        sampling: SamplingMode = "ras",
        generator: torch.Generator | None = None,
        prefix: PrefixCache | None = None,
        kv: KVSlot | None = None,
    ) -> LlmSession:
        """A new session for one utterance; min/max length are 2x/20x the text tokens (prompt excluded).

        With `prefix` (from `prefix_cache` of the same prompt text) the shared [sos, prompt_text] part is
        not recomputed; the first `step` then feeds only [text, task_id, prompt_speech]. With `kv` (a row of
        a `SlotKV`) the session decodes on that row, so `decode_batch` can batch it with others.
        """
        n_text = self._ids(text_tokens, "text token", self.text_vocab_size).numel()
        if prefix is not None:
            ids = tuple(int(t) for t in torch.as_tensor(list(prompt_text_tokens)).reshape(-1).tolist())
            if ids != prefix.prompt_text_tokens:
                raise ValueError("prefix cache was built for another prompt text")
            pending = torch.cat(
                [
                    self.embed_text(text_tokens),
                    self.special_embedding(TASK_ID_ROW),
                    self.embed_speech(prompt_speech_tokens),
                ],
                dim=1,
            )
            cache: DynamicCache | KVSlot
            if kv is not None:
                kv.load(prefix.cache)
                cache = kv
            else:
                cache = copy.deepcopy(prefix.cache)
        else:
            pending = self.lm_input(text_tokens, prompt_text_tokens, prompt_speech_tokens)
            cache = DynamicCache()
            if kv is not None:
                kv.length = 0
                cache = kv
        if sampling not in ("ras", "greedy"):
            raise ValueError(f"unknown sampling mode {sampling!r} (expected 'ras' or 'greedy')")
        return LlmSession(
            cache=cache,
            pending=pending,
            min_len=int(n_text * MIN_TOKEN_TEXT_RATIO),
            max_len=int(n_text * MAX_TOKEN_TEXT_RATIO),
            sampling=sampling,
            generator=generator,
        )

    @torch.inference_mode()
    def feed(self, session_cache: DynamicCache | KVSlot, embeds: Tensor) -> Tensor:
        """Run `embeds` [1, T, H] through the backbone on `session_cache`; raw logits [V] of the last one."""
        if isinstance(session_cache, DynamicCache):
            hidden = self.llm(embeds, session_cache)
        else:
            hidden = session_cache.feed(embeds)
        return self.llm_decoder(hidden[0, -1])

    @torch.inference_mode()
    def step(self, session: LlmSession, *, force: int | None = None) -> int | None:
        """Feed what is pending, pick the next speech token; None once the utterance has ended.

        `force` replaces the sampled id (teacher forcing in tests, fill tokens in bistream).
        """
        if session.finished:
            return None
        if session.pending is not None:
            session.logits = self.feed(session.cache, session.pending)
            session.pending = None
        return self.accept(session, force=force)

    def ban_ids(self, session: LlmSession) -> tuple[int, ...]:
        """The ids masked at this step (end of speech before min_len)."""
        return self.min_len_ban_ids if session.step_index < session.min_len else ()

    def accept(self, session: LlmSession, *, force: int | None = None) -> int | None:
        """Pick the next token from `session.logits` (the input fed); see `step`."""
        assert session.logits is not None
        if force is None:
            ban = self.ban_ids(session)
            token = sample_token(
                session.logits,
                session.out_tokens,
                mode=session.sampling,
                params=self.sampling_params,
                ban_ids=ban,
                generator=session.generator,
            )
        else:
            token = int(force)
        if token in self.stop_ids:
            session.finished = True
            return None
        session.out_tokens.append(token)
        if len(session.out_tokens) >= session.max_len:
            session.finished = True
        else:
            session.pending = self.speech_embedding.weight[token].reshape(1, 1, -1)
        return token

    def generate(
        self,
        text_tokens: Sequence[int] | Tensor,
        prompt_text_tokens: Sequence[int] | Tensor = (),
        prompt_speech_tokens: Sequence[int] | Tensor = (),
        *,
        sampling: SamplingMode = "ras",
        generator: torch.Generator | None = None,
    ) -> Iterator[int]:
        """Speech tokens one by one, as the official `Qwen2LM.inference` (HF path) yields them."""
        session = self.prefill(
            text_tokens, prompt_text_tokens, prompt_speech_tokens, sampling=sampling, generator=generator
        )
        while (token := self.step(session)) is not None:
            yield token


def check_state_dict(module: nn.Module, state_dict: dict[str, Tensor], source_name: str) -> None:
    """Raise ModelDirError naming the file and the missing/unexpected keys or wrong shapes."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    check_layout(state_dict, expected, source_name, f"{type(module).__name__} built from cosyvoice2.yaml")


def _retie(module: Qwen2LM) -> None:
    hf = module.llm.model
    if hf.config.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight


def load_llm_state_dict(module: Qwen2LM, state_dict: dict[str, Tensor], source_name: str) -> None:
    """Strict load of an official `llm.pt` dict into `module` (clear ModelDirError on any mismatch)."""
    check_state_dict(module, state_dict, source_name)
    _retie(module)
    module.load_state_dict(state_dict, strict=True)


def build_llm(
    config: LlmConfig,
    state_dict: dict[str, Tensor],
    source_name: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    cls: type[Qwen2LM] | None = None,
) -> Qwen2LM:
    """Construct on the meta device (no random init of ~0.5 B parameters), then load `state_dict`.

    `cls`: the module class (default `Qwen2LM`; CosyVoice3 passes its own)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    with torch.device("meta"):
        module = (cls or Qwen2LM)(config)
    check_state_dict(module, state_dict, source_name)
    module = module.to_empty(device=device)
    load_llm_state_dict(module, state_dict, source_name)
    module = module.to(dtype=dtype).eval().requires_grad_(False)
    # built after the cast: its inverse frequencies stay float32 (transformers computes the angles in
    # float32 from them and casts cos/sin to the activations' dtype); cast to bf16 they move the
    # angle at position 600 by 0.2 rad
    backbone = module.llm.model.model
    backbone.rotary_emb = Qwen2RotaryEmbedding(config=backbone.config).to(device)
    return module
