"""CosyVoice2Backend: the streaming CosyVoice2 engine behind the worker's Backend protocol.

Runs on the engine worker thread (every method but `voices()` and voice registration). Each `step` does
one bounded piece of one utterance's work — a few LLM decode steps, one flow + vocoder chunk, or a
frontend / segment transition — chosen by `Cv2State.next_action`; a chunk is ready the moment its
last lookahead token is decoded, so nothing waits or polls. Chunks of several utterances that advance
the flow by the same number of tokens run as one estimator batch (a partner a few tokens short is
decoded forward first); if a batch fails, each member is retried alone from a saved state so only the
utterance at fault fails. Every per-utterance cache is freed in `release`.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from voicertc.audio.decode import Clip
from voicertc.backends.cosyvoice2.bistream import BistreamSession
from voicertc.backends.cosyvoice2.device_lane import DeviceLane, resolve_device
from voicertc.backends.cosyvoice2.engine_state import Cv2State
from voicertc.backends.cosyvoice2.loader import CosyVoice2Model, load
from voicertc.backends.cosyvoice2.sampling import SamplingMode
from voicertc.backends.cosyvoice2.text import text_normalize
from voicertc.backends.cosyvoice2.token2wav import Chunk, ChunkPlan, Token2WavStream
from voicertc.backends.cosyvoice2.voices import Voice, VoiceBook, VoiceStore, voice_from_features
from voicertc.config import Config
from voicertc.engine.backend import Backend, SynthStep
from voicertc.engine.schedule import ChunkSchedule
from voicertc.engine.text_chunks import has_speech
from voicertc.engine.utterance import Utterance
from voicertc.errors import InputError

logger = logging.getLogger(__name__)

SAMPLE_RATE_HZ = 24000
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class BackendOptions:
    """Knobs that are not in config.toml (tests and benchmarks set them)."""

    decode_burst: int = 5  # LLM tokens per step at most
    max_batch: int = 8  # utterances per estimator batch (1 = never batch)
    batch_pull_tokens: int = 8  # a partner this many tokens short is decoded forward to join a batch
    sampling: SamplingMode = "ras"
    seed: int | None = None  # per-utterance RNGs from seed + crc32(utterance id); None = random
    max_segment_tokens: int | None = None  # cap on speech tokens per LLM call (tests, benchmarks)


@dataclass
class _Member:
    utt: Utterance
    state: Cv2State
    plan: ChunkPlan

    @property
    def t2w(self) -> Token2WavStream:
        assert self.state.t2w is not None
        return self.state.t2w


class CosyVoice2Backend:
    """The `cosyvoice2` engine backend (see the module docstring for the threading rules)."""

    name = "cosyvoice2"

    def __init__(
        self,
        model: CosyVoice2Model,
        schedule: ChunkSchedule | None = None,
        voices_dir: str | Path | None = None,
        options: BackendOptions | None = None,
    ) -> None:
        self.model = model
        self.schedule = schedule or ChunkSchedule()
        self.options = options or BackendOptions()
        self.book = VoiceBook(model, VoiceStore(voices_dir) if voices_dir else None)
        self.lane = DeviceLane(model.device)
        self._active: dict[str, Utterance] = {}
        self.stats = {"chunks": 0, "batches": 0, "batched_chunks": 0, "batch_fallbacks": 0}
        text_normalize("warm up.", lambda s: [0] * len(s))  # loads the normaliser grammars now, not later

    # ---- voices -------------------------------------------------------------------------------

    def voices(self) -> list[str]:
        """Any thread (a snapshot)."""
        return self.book.ids()

    def register_voice(
        self, wav_path: str | Path, transcript: str | None, voice_id: str | None = None
    ) -> str:
        """Zero-shot voice from a prompt recording; persisted in the voices directory.

        Runs model code (speech tokenizer, speaker embedding, flow prompt state, LLM prefix cache): call it
        on the engine thread, i.e. through `engine.submit_command(register_voice_command(...))`.
        """
        return self.book.register_wav(wav_path, transcript, voice_id).voice_id

    def register_clip(
        self, clip: Clip, transcript: str | None, voice_id: str | None = None, name: str = ""
    ) -> dict[str, object]:
        """Engine thread (an engine command): a zero-shot voice from a checked clip; its description."""
        return self.book.register(clip, transcript, voice_id, name).describe()

    def voice_infos(self) -> list[dict[str, object]]:
        return self.book.describe()

    def add_voice(self, voice: Voice, persist: bool = True) -> str:
        return self.book.add(voice, persist=persist).voice_id

    def delete_voice(self, voice_id: str) -> None:
        self.book.delete(voice_id)

    def warm_up(self) -> None:
        """Engine thread, before the engine reports ready: one LLM step and one flow + vocoder chunk on
        a prompt-free voice, so kernels, allocators and caches are set up before the first caller."""
        started = time.perf_counter()
        bins, dim = self.model.flow.cfg.mel_bins, self.model.flow.cfg.spk_embed_dim
        voice = voice_from_features(
            self.model, torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, bins), torch.zeros(1, dim),
            voice_id="warm-up", kind="sft",
        )  # fmt: skip
        with self.lane.compute():
            session = self.model.llm.prefill([0, 1, 2], sampling="greedy")
            self.model.llm.step(session)
            t2w = self.model.token2wav_stream(voice, self.schedule, pcm_to_host=self.lane.to_host)
            try:
                t2w.push([0] * (self.schedule.first_hop_tokens + self.schedule.lookahead_tokens))
                t2w.finish()
            finally:
                t2w.release()
        logger.info("cosyvoice2 warmed up in %.0f ms", 1000 * (time.perf_counter() - started))

    # ---- Backend protocol ---------------------------------------------------------------------

    def begin(self, utt: Utterance) -> None:
        voice = self.book.get(utt.voice)
        seed = self._seed(utt.utterance_id)
        utt.backend_state = Cv2State(
            voice=voice,
            llm_generator=torch.Generator(self.model.device).manual_seed(seed),
            hift_generator=torch.Generator().manual_seed(seed + 1),
        )
        self._active[utt.utterance_id] = utt

    def _seed(self, utterance_id: str) -> int:
        if self.options.seed is None:
            return int(torch.randint(0, 2**62, (1,)).item())
        return self.options.seed + zlib.crc32(utterance_id.encode())

    def has_work(self, utt: Utterance, now_s: float) -> bool:
        return utt.backend_state.next_action(utt) is not None

    def wake_at(self, utt: Utterance) -> float | None:
        return None  # only new text (a command) or our own progress makes work

    def step(self, utt: Utterance, now_s: float) -> SynthStep:
        st: Cv2State = utt.backend_state
        if st.started_s is None:
            st.started_s = now_s
            utt.add_metric("queue_wait_s", now_s - (utt.first_text_s or utt.opened_s))
        action = st.next_action(utt)
        pcm: list[np.ndarray] = []
        with self.lane.compute():
            if action == "raise":
                assert st.error is not None
                raise st.error
            if action == "emit":
                pcm = [st.ready_chunks.popleft().pcm]
            elif action == "chunk":
                pcm = [self._run_chunk(utt, st)]
            elif action == "frontend":
                self._frontend(utt, st)
            elif action == "decode":
                self._decode(utt, st)
            elif action == "finish":
                pcm = self._finish_segment(utt, st)
            elif action == "start":
                self._start_segment(utt, st)
            elif action == "done":
                st.done = True
        pcm = [p for p in pcm if p.size]
        return SynthStep(pcm=pcm, sample_rate_hz=SAMPLE_RATE_HZ, done=st.done and not st.ready_chunks)

    def release(self, utt: Utterance) -> None:
        self._active.pop(utt.utterance_id, None)
        if isinstance(utt.backend_state, Cv2State):
            utt.backend_state.release()
        utt.backend_state = None

    def close(self) -> None:
        for utt in list(self._active.values()):
            self.release(utt)

    # ---- frontend and LLM ---------------------------------------------------------------------

    def _frontend(self, utt: Utterance, st: Cv2State) -> None:
        started = time.perf_counter()
        encode = self.model.text_frontend.encode
        if st.mode == "whole":
            pieces = self._normalize(utt, utt.take_text(), split=True)
            st.segments = deque(ids for p in pieces if (ids := encode(p)))
        else:
            if st.bistream is None:
                voice = st.voice
                st.bistream = BistreamSession.start(
                    self.model.llm, voice.prompt_text_tokens, voice.llm_prompt_tokens,
                    sampling=self.options.sampling, generator=st.llm_generator,
                )  # fmt: skip
                st.t2w = self._open_t2w(st)
            while st.sentences:
                for text in self._normalize(utt, st.sentences.popleft(), split=False):
                    st.bistream.push_text(encode(text))
            if utt.input_ended and not st.text_ended:
                st.bistream.end_text()
                st.text_ended = True
        utt.add_metric("frontend_s", time.perf_counter() - started)

    def _normalize(self, utt: Utterance, text: str, split: bool) -> list[str]:
        """The official normalisation (+ split); text with nothing to say gives no pieces."""
        if not has_speech(text):
            return []
        try:
            return text_normalize(text, self.model.text_frontend.encode, split=split)
        except Exception:  # noqa: BLE001 - wetext asserts on some inputs: speak the raw text instead
            logger.warning("utterance %s: text normalisation failed; using the raw text", utt.utterance_id)
            return [text.strip()]

    def _open_t2w(self, st: Cv2State) -> Token2WavStream:
        return self.model.token2wav_stream(
            st.voice, self.schedule, generator=st.hift_generator, pcm_to_host=self.lane.to_host
        )

    def _start_segment(self, utt: Utterance, st: Cv2State) -> None:
        assert st.segments
        voice = st.voice
        st.llm = self.model.llm.prefill(
            st.segments.popleft(), voice.prompt_text_tokens, voice.llm_prompt_tokens,
            sampling=self.options.sampling, generator=st.llm_generator, prefix=voice.prefix,
        )  # fmt: skip
        if self.options.max_segment_tokens is not None:
            st.llm.max_len = min(st.llm.max_len, self.options.max_segment_tokens)
        st.llm_steps = 0
        st.t2w = self._open_t2w(st)

    def _llm_step(self, st: Cv2State) -> int | None:
        if st.llm is not None:
            return self.model.llm.step(st.llm)
        assert st.bistream is not None
        token = st.bistream.step()
        cap = self.options.max_segment_tokens
        if cap is not None and st.t2w is not None and len(st.t2w.tokens) + 1 >= cap:
            st.bistream.finished = True
        return token

    def _decode(self, utt: Utterance, st: Cv2State) -> None:
        """Up to `decode_burst` LLM steps; stops early when a chunk becomes ready or the LLM waits."""
        assert st.t2w is not None
        for _ in range(self.options.decode_burst):
            started = time.perf_counter()
            token = self._llm_step(st)
            now = time.perf_counter()
            prefill = st.llm_steps == 0
            st.llm_steps += 1
            utt.add_metric("llm_prefill_s" if prefill else "llm_decode_s", now - started)
            if prefill and st.first_hop_at_s is None:
                st.first_hop_at_s = now
            if token is not None:
                st.t2w.add_tokens([token])
            if st.t2w.ready():
                self._note_first_hop(utt, st)
                return
            if (st.llm is not None and st.llm.finished) or (
                st.bistream is not None and st.bistream.needs_text
            ):
                return
            if st.bistream is not None and st.bistream.finished:
                return

    def _note_first_hop(self, utt: Utterance, st: Cv2State) -> None:
        if not st.first_hop_recorded and st.first_hop_at_s is not None:
            st.first_hop_recorded = True
            utt.add_metric("decode_first_hop_s", time.perf_counter() - st.first_hop_at_s)

    def _finish_segment(self, utt: Utterance, st: Cv2State) -> list[np.ndarray]:
        assert st.t2w is not None
        chunks = st.t2w.finish()
        st.t2w = None
        st.llm = None
        for chunk in chunks:
            self._account(utt, chunk)
        return [c.pcm for c in chunks]

    # ---- flow + vocoder, batched across utterances --------------------------------------------

    def _run_chunk(self, utt: Utterance, st: Cv2State) -> np.ndarray:
        assert st.t2w is not None
        plan = st.t2w.plan()
        assert plan is not None
        group = [_Member(utt, st, plan), *self._partners(utt, plan)]
        results = self._flow_and_vocode(group)
        for member, result in zip(group[1:], results[1:], strict=True):
            if isinstance(result, BaseException):
                member.state.error = result
            else:
                member.state.ready_chunks.append(result)
        if isinstance(results[0], BaseException):
            raise results[0]
        return results[0].pcm

    def _partners(self, leader: Utterance, plan: ChunkPlan) -> list[_Member]:
        """Other utterances whose next chunk advances the flow by as many tokens (pulled forward)."""
        partners: list[_Member] = []
        for utt in list(self._active.values()):
            if len(partners) + 1 >= self.options.max_batch:
                break
            st = utt.backend_state
            if utt is leader or not isinstance(st, Cv2State) or not self._can_partner(utt, st):
                continue
            assert st.t2w is not None
            if not st.t2w.ready():
                self._pull_forward(utt, st)
            other = st.t2w.plan() if st.t2w.ready() else None
            if other is not None and other.advance_tokens == plan.advance_tokens:
                partners.append(_Member(utt, st, other))
        return partners

    def _can_partner(self, utt: Utterance, st: Cv2State) -> bool:
        if st.error is not None or st.ready_chunks or st.t2w is None or st.done:
            return False
        return utt.sink.has_room()

    def _pull_forward(self, utt: Utterance, st: Cv2State) -> None:
        """Decode a nearly-ready partner's last few tokens (its own RNG: same tokens as later)."""
        assert st.t2w is not None
        t2w, look = st.t2w, self.schedule.lookahead_tokens
        need = self.schedule.chunk_end_tokens(t2w.chunk_index, t2w.prompt_tokens) + look - len(t2w.tokens)
        if need > self.options.batch_pull_tokens or st.next_action(utt) != "decode":
            return
        try:
            while not t2w.ready() and st.next_action(utt) == "decode":
                self._decode(utt, st)
        except Exception as exc:  # noqa: BLE001 - the partner's failure is reported on its own step
            st.error = exc

    def _flow_and_vocode(self, group: list[_Member]) -> list[Chunk | BaseException]:
        if len(group) == 1:
            return [self._run_alone(group[0])]
        saved = [m.t2w.flow_state.clone() for m in group if m.t2w.flow_state is not None]
        started = time.perf_counter()
        try:
            tokens = [m.plan.new_tokens for m in group]
            states = [m.t2w.flow_state for m in group]
            mels = self.model.flow.stream_step_batch(tokens, states, finalize=False)  # type: ignore[arg-type]
        except Exception:
            logger.warning("batched flow step failed; retrying its %d utterances one by one", len(group))
            self.stats["batch_fallbacks"] += 1
            for member, state in zip(group, saved, strict=True):
                member.t2w.flow_state = state
            return [self._run_alone(m) for m in group]
        flow_s = (time.perf_counter() - started) / len(group)
        self.stats["batches"] += 1
        self.stats["batched_chunks"] += len(group)
        results: list[Chunk | BaseException] = []
        for member, mel in zip(group, mels, strict=True):
            try:
                results.append(self._account(member.utt, member.t2w.complete(member.plan, mel, flow_s)))
            except Exception as exc:  # noqa: BLE001 - isolated per utterance
                results.append(exc)
        return results

    def _run_alone(self, member: _Member) -> Chunk | BaseException:
        try:
            return self._account(member.utt, member.t2w.run(member.plan))
        except Exception as exc:  # noqa: BLE001 - isolated per utterance
            return exc

    def _account(self, utt: Utterance, chunk: Chunk) -> Chunk:
        utt.add_metric("flow_s", chunk.flow_s)
        utt.add_metric("vocoder_s", chunk.vocoder_s)
        self.stats["chunks"] += 1
        return chunk


def register_voice_command(
    wav_path: str | Path, transcript: str, voice_id: str | None = None
) -> Callable[[Backend], str]:
    """An engine command (`EngineWorker.submit_command`) registering a zero-shot voice on the engine
    thread, between steps; the future gets the voice id (or InputError for a bad prompt)."""

    def register(backend: Backend) -> str:
        if not isinstance(backend, CosyVoice2Backend):
            raise InputError(f"the {backend.name} engine cannot register voices")
        return backend.register_voice(wav_path, transcript, voice_id)

    return register


def create_backend(config: Config) -> CosyVoice2Backend:
    """Load `config.engine.model_dir` on the configured device and wrap it as the engine backend."""
    engine = config.engine
    device = resolve_device(engine.device)
    dtype = DTYPES[engine.dtype] if device.type == "cuda" else torch.float32
    model = load(engine.model_dir, device, dtype)
    s = config.schedule
    schedule = ChunkSchedule(
        first_hop_tokens=s.first_hop_tokens,
        growth=s.growth,
        max_hop_tokens=s.max_hop_tokens,
        lookahead_tokens=s.lookahead_tokens,
        grid_tokens=s.grid_tokens or None,
    )
    backend = CosyVoice2Backend(model, schedule, engine.voices_dir or None)
    backend.warm_up()
    return backend
