"""CosyVoice2 flow (`CausalMaskedDiffWithXvec`): speech tokens (25 Hz) -> 80-bin log-mel (50 Hz).

Runs on the engine thread. Two ways in:
* `infer(...)` reproduces the reference `flow.inference` over a whole token prefix (what the
  official streaming loop re-runs for every chunk);
* `init_stream(...)` + `stream_step(...)` compute each chunk from its own tokens plus an explicit
  `FlowStreamState` (encoder and estimator caches), so a chunk costs work proportional to the chunk,
  not to what was already spoken. With chunk ends on the 25-token grid counted from the prompt start
  the result equals the chunk-masked whole-utterance computation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voicertc.backends.cosyvoice.accel.staging import to_device
from voicertc.backends.cosyvoice.flow.cfm import CausalConditionalCFM, EulerSolve, fixed_noise
from voicertc.backends.cosyvoice.flow.config import NOISE_FRAMES, YAML_NAME, FlowConfig
from voicertc.backends.cosyvoice.flow.encoder import EncoderCache, UpsampleConformerEncoder, rows_line_up
from voicertc.backends.cosyvoice.flow.kv import KVCache
from voicertc.backends.cosyvoice.flow.unet import EstimatorCache
from voicertc.backends.cosyvoice.load.checkpoint import check_layout
from voicertc.backends.cosyvoice.load.yaml_config import load_yaml
from voicertc.engine.parts import Parts, run_to_end
from voicertc.errors import InputError, ModelDirError

# token embeddings [B, T, D_in], lookahead embeddings [B, L, D_in] | None, lined-up caches, chunk masks
EncoderRunner = Callable[[Tensor, Tensor | None, list[EncoderCache], bool], Tensor]

logger = logging.getLogger(__name__)

FLOW_WEIGHTS_NAME = "flow.pt"
# K/V room reserved up front on CPU: 30 s of speech. Untouched capacity costs only address space there
# (pages are mapped on first write), while moving a long history into a grown buffer costs real time.
# On an accelerator the memory is real and a move takes microseconds, so buffers start small and grow.
CPU_KV_RESERVE_TOKENS = 750


def kv_reserve_tokens(device: torch.device) -> int:
    return CPU_KV_RESERVE_TOKENS if device.type == "cpu" else 0


@dataclass
class FlowStreamState:
    """One utterance's flow state (owned by the engine thread; `stream_step` mutates only it).

    Invariant: the first `encoder.tokens` tokens of [prompt ++ generated] are fully synthesised and
    that count is on the chunk grid (until `finished`); `pending_prompt` holds the prompt tokens not
    yet encoded (they are computed with the first chunk because their chunk is still open).
    A call that raises after validation leaves the state unusable: drop the utterance."""

    spks: Tensor  # [1, 80] projected speaker embedding
    prompt_feat: Tensor  # [1, 2p, 80] prompt mel, the CFM condition of the prompt frames
    pending_prompt: Tensor  # [1, k] prompt tokens still to encode
    encoder: EncoderCache
    estimator: list[EstimatorCache]  # one per Euler step, rows = CFG pair
    finished: bool = False

    @property
    def frames(self) -> int:
        return self.estimator[0].frames

    def kv_caches(self) -> list[KVCache]:
        caches = self.encoder.layers + self.encoder.up_layers
        return caches + [kv for c in self.estimator for kv in c.attention.values()]

    def cache_bytes(self) -> int:
        """Bytes of cached context (the estimator K/V dominate: they grow with every frame). The K/V
        buffers have spare room beyond this (`flow_kv`; on CPU mostly untouched address space)."""
        enc = self.encoder
        tails = [enc.lookahead_tail, enc.upsample_tail] + [
            t for c in self.estimator for t in c.conv_tails.values()
        ]
        tail_bytes = sum(t.numel() * t.element_size() for t in tails if t is not None)
        packed = sum(c.packed.nbytes() for c in self.estimator if c.packed is not None)
        return tail_bytes + packed + sum(kv.filled_bytes() for kv in self.kv_caches())

    def reserve(self, new_frames: int) -> None:
        """Room in every packed estimator context for `new_frames` more frames (`PackedCache.reserve`:
        a context that outgrows its room moves now, once; the per-slot form grows as it appends)."""
        for cache in self.estimator:
            if cache.packed is not None:
                cache.packed.reserve(cache.packed.frames + new_frames)

    def clone(self) -> FlowStreamState:
        """An independent copy (e.g. a voice's prompt state reused per utterance, or a batch member's
        state saved for a retry). Cheap: the K/V so far become a read-only prefix of the clone's caches
        (`KVCache.fork`: never copied, also not by the clone's first chunk), the other cached tensors
        are never written in place, so no tensor data is copied here."""
        enc = self.encoder
        encoder = replace(
            enc,
            layers=[c.fork() for c in enc.layers],
            up_layers=[c.fork() for c in enc.up_layers],
        )
        return replace(self, encoder=encoder, estimator=[c.share() for c in self.estimator])


@dataclass
class _Chunk:
    """Tokens one state advances by in one call."""

    state: FlowStreamState
    tokens: Tensor  # [1, T] real tokens (pending prompt ++ new)
    context: Tensor | None  # [1, lookahead] or None when final
    drop_frames: int  # leading frames that belong to the prompt


class CausalFlow(nn.Module):
    """Checkpoint-compatible flow: `state_dict()` keys and shapes equal the official `flow.pt`."""

    encodes_rows = True  # utterances that line up share one encoder forward (`_encode_all`)

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.mel_bins)
        self.encoder = UpsampleConformerEncoder(cfg.encoder, cfg.pre_lookahead_tokens)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.mel_bins)
        self.decoder = CausalConditionalCFM(cfg.estimator, cfg.n_timesteps, cfg.inference_cfg_rate)
        # `[engine] cuda_graphs`: the token encoder's captured static steps (`flow.captured_encoder`);
        # called as `forward_rows` is, for one row or several that line up
        self.encoder_runner: EncoderRunner | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu") -> CausalFlow:
        """Build from `cosyvoice2.yaml` and load `flow.pt` strictly, as the official loader does."""
        model_dir = Path(model_dir)
        cfg = FlowConfig.from_yaml(load_yaml(model_dir / YAML_NAME).get("flow", {}))
        flow = cls(cfg)
        path = model_dir / FLOW_WEIGHTS_NAME
        try:
            weights = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError) as exc:
            raise ModelDirError(f"{path}: cannot load ({exc})") from exc
        load_flow_state_dict(flow, weights, str(path))
        return flow.to(device).eval()

    # ----------------------------------------------------------------- whole prefix (reference)
    @torch.inference_mode()
    def infer(
        self,
        tokens: Tensor,
        prompt_tokens: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        *,
        streaming: bool,
        finalize: bool,
    ) -> Tensor:
        """The reference `flow.inference`: [1, n] tokens -> mel [1, 80, 2n] (2(n-3) if not finalize).

        `streaming` selects the chunk attention masks; `finalize=False` treats the last 3 tokens
        as lookahead only."""
        # tokens: [1, n], prompt_tokens: [1, p], prompt_feat: [1, 2p, 80], embedding: [1, 192]
        state = self._new_state(prompt_tokens, prompt_feat, embedding)
        chunk = self._chunk(state, self._check_tokens(tokens, "tokens"), finalize, check_grid=False)
        return self._run([chunk], chunk_masks=streaming)[0]

    @torch.inference_mode()
    def start_window(
        self,
        tokens: Tensor,
        prompt_tokens: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        *,
        streaming: bool,
        finalize: bool,
    ) -> WindowSolve:
        """`infer` in bounded parts: the encoder now, the Euler steps in `advance_window` calls (a
        full-attention call over many tokens would otherwise hold the engine thread for all of them)."""
        state = self._new_state(prompt_tokens, prompt_feat, embedding)
        chunk = self._chunk(state, self._check_tokens(tokens, "tokens"), finalize, check_grid=False)
        if chunk.tokens.shape[1] == 0:
            return WindowSolve(None, 0, state.spks.new_zeros(1, self.cfg.mel_bins, 0))
        return WindowSolve(self._start([chunk], chunk_masks=streaming), chunk.drop_frames)

    @torch.inference_mode()
    def advance_window(
        self, window: WindowSolve, euler_steps: int | None = None, *, parts: int | None = None
    ) -> Tensor | None:
        """The next `euler_steps` of `window` (None: all left), or its next `parts` (`CausalConditionalCFM.
        advance_part`); its mel [1, 80, F] once solved, else None."""
        if window.mel is None and window.solve is not None:
            if self._advance(window.solve, euler_steps, parts):
                window.mel = window.solve.x.float()[:, :, window.drop_frames :]
                window.solve = None  # the estimator caches of a full-attention call go now
        return window.mel

    # ----------------------------------------------------------------- incremental
    @torch.inference_mode()
    def init_stream(self, prompt_tokens: Tensor, prompt_feat: Tensor, embedding: Tensor) -> FlowStreamState:
        """State after the prompt: every complete grid chunk of the prompt whose lookahead is also in
        the prompt is computed now (once per voice; `clone()` the result per utterance)."""
        return run_to_end(self.init_stream_parts(prompt_tokens, prompt_feat, embedding))

    def init_stream_parts(
        self, prompt_tokens: Tensor, prompt_feat: Tensor, embedding: Tensor
    ) -> Parts[FlowStreamState]:
        """`init_stream` in bounded parts (the encoder, then an estimator stage or Euler step each:
        `advance_part`), so a voice's prompt never holds the engine thread for all of it. The inputs are
        checked now (ValueError), before any part; run each part under `torch.inference_mode()`."""
        state = self._new_state(prompt_tokens, prompt_feat, embedding)
        return self._prompt_parts(state)

    def _prompt_parts(self, state: FlowStreamState) -> Parts[FlowStreamState]:
        """The prompt streamed a grid chunk at a time (each with the next 3 prompt tokens as its
        lookahead), exactly as an utterance's own chunks are: each chunk's encoder pass, then its
        Euler steps in parts. Every part is bounded by one chunk, whatever the prompt's length (one
        pass over a 30 s prompt was 2.6 s of encoder alone on the tiny model)."""
        lookahead, grid = self.cfg.pre_lookahead_tokens, self.cfg.chunk_tokens
        prompt = state.pending_prompt
        ready = max(prompt.shape[1] - lookahead, 0) // grid * grid
        for start in range(0, ready, grid):
            end = start + grid
            chunk = _Chunk(state, prompt[:, start:end], prompt[:, end : end + lookahead], 2 * grid)
            solve = self._start([chunk], chunk_masks=True)
            yield
            while not self._advance(solve, None, parts=1):
                yield
        state.pending_prompt = prompt[:, ready:]
        return state

    def stream_step(self, new_tokens: Tensor, state: FlowStreamState, finalize: bool) -> Tensor:
        """Mel of the next chunk: [1, n] new tokens (incl. the 3 lookahead tokens unless `finalize`,
        which the next call must pass again) -> [1, 80, 2(n-3)] ([1, 80, 2n] when finalize).

        A non-final chunk must end on the chunk grid counted from the prompt start (the first chunk
        carries the prompt pad), otherwise the cached frames would not be final."""
        return self.stream_step_batch([new_tokens], [state], finalize)[0]

    @torch.inference_mode()
    def stream_step_batch(
        self, new_tokens: list[Tensor], states: list[FlowStreamState], finalize: bool
    ) -> list[Tensor]:
        """`stream_step` for several utterances at once; the estimator runs them as one batch. All
        must compute the same number of frames this call (same chunk length incl. pending prompt)."""
        mels = self.advance_stream(self.start_stream_batch(new_tokens, states, finalize))
        assert mels is not None
        return mels

    @torch.inference_mode()
    def start_stream_batch(
        self, new_tokens: list[Tensor], states: list[FlowStreamState], finalize: bool
    ) -> StreamSolve:
        """`stream_step_batch` in bounded parts: the encoder now (the states' encoder caches advance),
        the Euler steps in `advance_stream` calls (each step appends to its own estimator caches, so
        the parts together compute exactly what one call does)."""
        if len(new_tokens) != len(states) or not states:
            raise ValueError("stream_step_batch needs one token tensor per state (and at least one)")
        chunks = [
            self._chunk(s, self._check_tokens(t, "new_tokens"), finalize, check_grid=True)
            for t, s in zip(new_tokens, states, strict=True)
        ]
        if len({c.tokens.shape[1] for c in chunks}) != 1:
            raise ValueError("stream_step_batch: every utterance must advance by the same number of tokens")
        solve = self._start(chunks, chunk_masks=True) if chunks[0].tokens.shape[1] else None
        return StreamSolve(solve, [c.drop_frames for c in chunks], states, finalize)

    @torch.inference_mode()
    def reserve_stream(self, new_tokens: list[Tensor], states: list[FlowStreamState], finalize: bool) -> None:
        """Room in each state's estimator contexts for the frames its next chunk adds, made before a
        batch saves its states for a retry: a context that outgrows its room then moves before the
        save, so the saved copy shares the moved tensor. Moved during the chunk, the old tensor stayed
        alive in the saved copy until the chunk ended: twice the memory of every growing context, all
        at once for utterances that started together (32 of them ran an H100 out of memory)."""
        lookahead, ratio = self.cfg.pre_lookahead_tokens, self.cfg.token_mel_ratio
        for tokens, state in zip(new_tokens, states, strict=True):
            real = state.pending_prompt.shape[1] + tokens.shape[1] - (0 if finalize else lookahead)
            state.reserve(ratio * max(0, real))

    @torch.inference_mode()
    def advance_stream(
        self, stream: StreamSolve, euler_steps: int | None = None, *, parts: int | None = None
    ) -> list[Tensor] | None:
        """The next `euler_steps` of `stream` (None: all left), or its next `parts` (an estimator stage
        each on the eager estimator); each state's mel [1, 80, F] once solved, else None."""
        solve = stream.solve
        if solve is not None and not self._advance(solve, euler_steps, parts):
            return None
        for state in stream.states:
            state.finished = stream.finalize
        if solve is None:
            return [s.spks.new_zeros(1, self.cfg.mel_bins, 0) for s in stream.states]
        mel = solve.x.float()
        return [mel[i : i + 1, :, drop:] for i, drop in enumerate(stream.drop_frames)]

    # ----------------------------------------------------------------- internals
    def _advance(self, solve: EulerSolve, euler_steps: int | None, parts: int | None) -> bool:
        if parts is None:
            return self.decoder.advance(solve, euler_steps)
        if euler_steps is not None:
            raise ValueError("advance by euler_steps or by parts, not both")
        done = False
        for _ in range(parts):
            done = self.decoder.advance_part(solve)
            if done:
                break
        return done

    def _check_tokens(self, tokens: Tensor, name: str) -> Tensor:
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError(f"{name} must have shape [1, n], got {list(tokens.shape)}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.cfg.vocab_size):
            bad = tokens[(tokens < 0) | (tokens >= self.cfg.vocab_size)][0]
            raise ValueError(f"{name}: speech token id {int(bad)} outside [0, {self.cfg.vocab_size})")
        device = self.input_embedding.weight.device
        if tokens.device.type == "cpu":  # pinned: a chunk's ids do not wait for the work queued before
            return to_device(tokens.to(torch.long), device)
        return tokens.to(device, torch.long)

    def _new_state(self, prompt_tokens: Tensor, prompt_feat: Tensor, embedding: Tensor) -> FlowStreamState:
        prompt_tokens = self._check_tokens(prompt_tokens, "prompt_tokens")
        p, ratio, bins = prompt_tokens.shape[1], self.cfg.token_mel_ratio, self.cfg.mel_bins
        if prompt_feat.dim() != 3 or prompt_feat.shape[0] != 1 or prompt_feat.shape[2] != bins:
            raise ValueError(
                f"prompt_feat must have shape [1, {ratio}p, {bins}], got {list(prompt_feat.shape)}"
            )
        if prompt_feat.shape[1] != ratio * p:
            raise ValueError(
                f"prompt_feat has {prompt_feat.shape[1]} frames but the prompt has {p} tokens "
                f"(expected {ratio * p})"
            )
        if embedding.shape != (1, self.cfg.spk_embed_dim):
            raise ValueError(
                f"embedding must have shape [1, {self.cfg.spk_embed_dim}], got {list(embedding.shape)}"
            )
        weight = self.spk_embed_affine_layer.weight
        spks = self.spk_embed_affine_layer(F.normalize(embedding.to(weight), dim=1))
        reserve_tokens = kv_reserve_tokens(weight.device)
        estimator = self.decoder.new_caches()
        for cache in estimator:
            cache.reserve_frames = reserve_tokens * self.cfg.token_mel_ratio
        return FlowStreamState(
            spks=spks,
            prompt_feat=prompt_feat.to(weight),
            pending_prompt=prompt_tokens,
            encoder=self._new_encoder_cache(reserve_tokens),
            estimator=estimator,
        )

    def _new_encoder_cache(self, reserve_tokens: int) -> EncoderCache:
        return self.encoder.new_cache(reserve_tokens)

    def _chunk(self, state: FlowStreamState, tokens: Tensor, finalize: bool, check_grid: bool) -> _Chunk:
        if state.finished:
            raise ValueError("this flow stream is already finalized")
        lookahead, grid = self.cfg.pre_lookahead_tokens, self.cfg.chunk_tokens
        pending = state.pending_prompt
        everything = torch.cat([pending, tokens], dim=1)
        context = None
        if not finalize:
            if tokens.shape[1] < lookahead:
                raise ValueError(f"a non-final chunk needs at least the {lookahead} lookahead tokens")
            everything, context = everything[:, :-lookahead], everything[:, -lookahead:]
        end = state.encoder.tokens + everything.shape[1]
        if check_grid and not finalize and end % grid:
            raise ValueError(
                f"a non-final chunk must end on the {grid}-token grid counted from the prompt start: it "
                f"would end at token {end}; pad the first chunk by {-end % grid} tokens (or use "
                f"hops that are multiples of {grid})"
            )
        if end * self.cfg.token_mel_ratio > NOISE_FRAMES:
            raise InputError(
                f"prompt + speech of {end} tokens exceeds the flow's {NOISE_FRAMES} mel frames "
                f"({NOISE_FRAMES // 50} s)"
            )
        return _Chunk(state, everything, context, self.cfg.token_mel_ratio * pending.shape[1])

    def _encode(self, chunk: _Chunk, chunk_masks: bool) -> Tensor:
        # -> mu [1, 80, 2T] for the chunk's tokens
        state = chunk.state
        token_emb = self.input_embedding(chunk.tokens)
        context_emb = self.input_embedding(chunk.context) if chunk.context is not None else None
        if self.encoder_runner is not None:
            h = self.encoder_runner(token_emb, context_emb, [state.encoder], chunk_masks)
        else:
            h = self.encoder(token_emb, context_emb, state.encoder, chunk_masks)
        return self.encoder_proj(h).transpose(1, 2)

    def _encode_all(self, chunks: list[_Chunk], chunk_masks: bool) -> Tensor:
        """mu [B, 80, 2T] of every chunk: one batched encoder forward when the utterances line up (the
        same tokens encoded so far and now: utterances that started together), else one each."""
        if self.encodes_rows and len(chunks) > 1 and _chunks_line_up(chunks):
            token_emb = self.input_embedding(torch.cat([c.tokens for c in chunks]))
            contexts = [c.context for c in chunks if c.context is not None]
            context_emb = self.input_embedding(torch.cat(contexts)) if contexts else None
            caches = [c.state.encoder for c in chunks]
            runner = self.encoder_runner or self.encoder.forward_rows
            h = runner(token_emb, context_emb, caches, chunk_masks)
            return self.encoder_proj(h).transpose(1, 2)
        return torch.cat([self._encode(c, chunk_masks) for c in chunks], dim=0)

    def _cond(self, state: FlowStreamState, start: int, frames: int) -> Tensor:
        # -> [1, 80, frames]: the prompt mel where the chunk overlaps the prompt, zeros after
        cond = state.spks.new_zeros(1, self.cfg.mel_bins, frames)
        prompt = state.prompt_feat[:, start : start + frames].transpose(1, 2)
        cond[:, :, : prompt.shape[2]] = prompt
        return cond

    def _run(self, chunks: list[_Chunk], chunk_masks: bool) -> list[Tensor]:
        # -> per chunk: mel [1, 80, frames - drop_frames]
        if chunks[0].tokens.shape[1] == 0:
            return [c.state.spks.new_zeros(1, self.cfg.mel_bins, 0) for c in chunks]
        mel = self.decoder(*self._cfm_inputs(chunks, chunk_masks))
        return [mel[i : i + 1, :, c.drop_frames :] for i, c in enumerate(chunks)]

    def _start(self, chunks: list[_Chunk], chunk_masks: bool) -> EulerSolve:
        """Encode the chunks (their states advance now) and set up their CFM solve."""
        return self.decoder.start(*self._cfm_inputs(chunks, chunk_masks))

    def _cfm_inputs(
        self, chunks: list[_Chunk], chunk_masks: bool
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, list[list[EstimatorCache]], bool]:
        """Encode the chunks (their states advance now): the CFM's noise, mu, speaker, condition."""
        starts = [c.state.frames for c in chunks]
        for c in chunks:  # the pending prompt tokens are part of this chunk now
            c.state.pending_prompt = c.state.pending_prompt[:, :0]
        mu = self._encode_all(chunks, chunk_masks)
        frames = mu.shape[2]
        noise = torch.cat([fixed_noise()[:, :, s : s + frames] for s in starts], dim=0).to(mu)
        cond = torch.cat([self._cond(c.state, s, frames) for c, s in zip(chunks, starts, strict=True)], dim=0)
        spks = torch.cat([c.state.spks for c in chunks], dim=0)
        return noise, mu, spks, cond, [c.state.estimator for c in chunks], chunk_masks


def _chunks_line_up(chunks: list[_Chunk]) -> bool:
    first = chunks[0]
    return (
        all(c.tokens.shape == first.tokens.shape for c in chunks)
        and all((c.context is None) == (first.context is None) for c in chunks)
        and all(
            c.context is None or first.context is None or c.context.shape == first.context.shape
            for c in chunks
        )
        and rows_line_up([c.state.encoder for c in chunks])
    )


@dataclass
class StreamSolve:
    """A batched streaming flow chunk between its Euler steps (engine thread): what `advance_stream`
    needs to go on and to cut each utterance's mel out of the batch at the end."""

    solve: EulerSolve | None  # None: the chunk has no tokens (nothing to solve)
    drop_frames: list[int]  # per utterance: leading frames that belong to the prompt
    states: list[FlowStreamState]
    finalize: bool


@dataclass
class WindowSolve:
    """A whole-prefix (full-attention) flow call between bounded parts; `mel` once solved."""

    solve: EulerSolve | None  # None once solved (or for no tokens)
    drop_frames: int  # leading frames that belong to the prompt
    mel: Tensor | None = None  # [1, 80, F]


def load_flow_state_dict(module: CausalFlow, state_dict: dict[str, Tensor], source_name: str) -> None:
    """Strict load with an error that names the offending keys / shapes and the file."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    check_layout(state_dict, expected, source_name, f"flow built from {YAML_NAME}")
    module.load_state_dict(state_dict, strict=True)
    logger.debug("loaded flow weights from %s (%d tensors)", source_name, len(state_dict))
