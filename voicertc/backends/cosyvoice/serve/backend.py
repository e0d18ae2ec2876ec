"""CosyVoice2Backend: the streaming CosyVoice2 engine behind the worker's `BatchBackend` protocol.

Runs on the engine worker thread (every method but `voices()`). `plan(utt)` names the utterance's next
unit (`Cv2State.plan`, no side effects); `run(batch)` does a batch the scheduler formed:

* `Decode`    up to `decode_burst` LLM steps for every row at once, fewer if another would pass
  `[engine] max_step_ms` (`llm_batch.decode_batch` on the static slot KV cache; each row samples with
  its own generator); a row leaves the burst when its next chunk becomes ready, its LLM ends, or it
  waits for text;
* `FlowChunk` one estimator batch of the rows `form_batch` gathered (at most `[engine] max_batch`) of
  equal advance (if it fails, each row is retried alone from a saved state, so only the utterance at
  fault fails); its Euler steps go on in later units while another would pass `[engine] max_step_ms`
  (`PendingFlow`: the same rows, continued together; split or not, the mel is the same bit for bit);
* `Vocode`    one HiFT forward for every row of equal vocoder length (`hift_batch.vocode_batch`: per-row
  caches and generators; every row's device->host copy is queued before the first wait);
* `Frontend` / `Prefill` / `Finish` one utterance at a time (cheap transitions).

A chunk is ready the moment its last lookahead token is decoded, so nothing waits or polls. Every
per-utterance cache (KV slot, flow and HiFT state) is freed in `release`.
"""

from __future__ import annotations

import itertools
import logging
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from voicertc.audio.decode import Clip
from voicertc.backends.cosyvoice.accel.apply import apply_accel, vllm_export_dir
from voicertc.backends.cosyvoice.accel.captured import Capture, CudaCapture, run_eagerly
from voicertc.backends.cosyvoice.accel.tape import TapeCapture
from voicertc.backends.cosyvoice.flow.flow import FlowStreamState, StreamSolve
from voicertc.backends.cosyvoice.flow.unet import GROW_FRAMES
from voicertc.backends.cosyvoice.hift.batch import vocode_batch, vocode_batch_parts
from voicertc.backends.cosyvoice.llm.ahead import DROPPED, DecodeAhead, DecodeLaunch, can_launch, launch, read
from voicertc.backends.cosyvoice.llm.batch import decode_batch
from voicertc.backends.cosyvoice.llm.bistream import BistreamSession
from voicertc.backends.cosyvoice.llm.graphs import DecodeGraphs
from voicertc.backends.cosyvoice.llm.kv import KVSlot, SlotKV
from voicertc.backends.cosyvoice.llm.qwen2lm import MAX_TOKEN_TEXT_RATIO, MIN_TOKEN_TEXT_RATIO, LlmSession
from voicertc.backends.cosyvoice.llm.sampling import SamplingMode
from voicertc.backends.cosyvoice.llm.streamer import SpeechTokenStreamer, StreamedSession, ThreadedSpeechLlm
from voicertc.backends.cosyvoice.load import load_v2 as load
from voicertc.backends.cosyvoice.load.files import torch_dtype
from voicertc.backends.cosyvoice.load.v2 import CosyVoice2Model
from voicertc.backends.cosyvoice.serve.captured_stages import (
    CapturedStages,
    install_captured_steps,
    remove_captured_steps,
)
from voicertc.backends.cosyvoice.serve.device_lane import DeviceLane, resolve_device
from voicertc.backends.cosyvoice.serve.modes import LlmPrompt, llm_prompt
from voicertc.backends.cosyvoice.serve.state import (
    Cv2State,
    FlowedChunk,
    HiftSnapshot,
    PendingFlow,
    PendingVocode,
)
from voicertc.backends.cosyvoice.serve.step_budget import Clock, StepBudget, UnitClock
from voicertc.backends.cosyvoice.serve.streams import token2wav_stream
from voicertc.backends.cosyvoice.serve.token2wav import Chunk, ChunkPlan, Token2WavStream
from voicertc.backends.cosyvoice.voice.text import SentenceStream, text_normalize
from voicertc.backends.cosyvoice.voice.text_prep import (
    DEFAULT_CHUNK_CHARS,
    ProcessTextPrep,
    prep_chunks,
    text_prep_for,
)
from voicertc.backends.cosyvoice.voice.voices import (
    Voice,
    VoiceBook,
    VoiceFeatures,
    VoiceStore,
    voice_from_features,
)
from voicertc.config import Config, EngineConfig
from voicertc.engine.backend import Backend, StepResult, SynthStep
from voicertc.engine.parts import InParts, Parts
from voicertc.engine.schedule import ChunkSchedule
from voicertc.engine.text_chunks import has_speech
from voicertc.engine.utterance import Utterance
from voicertc.engine.voice_book import BackendVoiceBook
from voicertc.engine.work import (
    Decode,
    Finish,
    FlowChunk,
    Frontend,
    Job,
    Prefill,
    Vocode,
    VoicePrompt,
    Work,
)
from voicertc.errors import ConfigError, InputError

logger = logging.getLogger(__name__)

SAMPLE_RATE_HZ = 24000
# Euler steps of a full-attention flow call (a speed window, a "reference" final chunk) per engine step:
# such a call covers up to `speed_window_tokens`, so one step of it costs about what a streaming chunk's
# ten steps do, and a cancel or another call's unit lands between them.
WINDOW_EULER_STEPS = 1
# LLM positions per slot preallocated when the decode graphs are captured: growing the slot cache moves
# it, and every decode graph is captured again (mid-load, in other calls' time); 2048 holds a prompt and
# a long segment (~12 KB a position a slot in bf16 on the 0.5B model: 0.4 GB for 17 slots)
GRAPH_KV_CAPACITY = 2048


@dataclass(frozen=True)
class BackendOptions:
    """Knobs that are not in config.toml (tests and benchmarks set them)."""

    decode_burst: int = 5  # LLM tokens per Decode unit at most
    flow_batch_rows: int | None = None  # rows per estimator call at most (None = the scheduler's batch)
    kv_slots: int = 8  # LLM slot KV cache rows preallocated (doubles when full)
    kv_capacity: int = 512  # positions per row preallocated (doubles when needed)
    sampling: SamplingMode = "ras"
    seed: int | None = None  # per-utterance RNGs from seed + crc32(utterance id); None = random
    max_segment_tokens: int | None = None  # hard cap on speech tokens per LLM call ([limits])
    speed_window_tokens: int = 500  # a speed-changed segment's flow call covers this many tokens at most
    cuda_graphs: bool = False  # every stage as CUDA graph replays (decode, flow, vocoder; CUDA only)
    compile_steps: bool = False  # the static decode and flow steps compiled (inductor) before capture
    graph_rows: int = 16  # the largest bucket captured, in utterances (more rows run eagerly, counted)
    graph_memory_mb: float = 0.0  # flow + vocoder buckets together (0 = a quarter of the card)
    static_steps: bool = False  # flow + vocoder through the static-shape path without capture (CPU tests)
    static_decode: bool = False  # the LLM's decode graphs' static steps without capture (CPU tests)
    decode_ahead: bool = True  # with decode graphs: launch a step before reading the one before (`llm.ahead`)
    graph_warm_keys: int = 1024  # flow histories (frames) whose buckets are captured at start (CUDA)
    text_workers: int = 0  # text preparation processes ([engine] text_workers; 0 = on the engine thread)
    prep_chars: int = DEFAULT_CHUNK_CHARS  # one text preparation job at most, in characters
    bistream_unit: str = "word"  # text deltas reach the LLM per completed word | sentence
    max_step_ms: float = 0.0  # an engine unit's CPU time at most ([engine] max_step_ms; 0 = unbounded)
    max_streaming: int = 0  # utterances holding flow contexts at once ([engine] max_streaming; 0 = auto)
    streaming_context_s: float = 30.0  # speech an auto `max_streaming` gives each utterance room for
    step_clock: Clock = time.thread_time  # what `max_step_ms` is measured with (tests inject one)


Cv2Job = Job[Cv2State]


class CosyVoice2Backend:
    """The `cosyvoice2` engine backend (see the module docstring for the threading rules)."""

    name = "cosyvoice2"

    def __init__(
        self,
        model: CosyVoice2Model,
        schedule: ChunkSchedule | None = None,
        voices_dir: str | Path | None = None,
        options: BackendOptions | None = None,
        streamer: SpeechTokenStreamer | None = None,
    ) -> None:
        self.model = model
        self.streamer = streamer  # whole-text segments decode there (`[engine] llm`), None = here
        self._wake: Callable[[], None] = lambda: None
        self.schedule = schedule or ChunkSchedule()
        self.options = options or BackendOptions()
        self.book = VoiceBook(model, VoiceStore(voices_dir) if voices_dir else None)
        self.voice_book: BackendVoiceBook | None = self  # register_clip / voice_infos / delete_voice
        self.lane = DeviceLane(model.device)
        slots, capacity = self.options.kv_slots, self.options.kv_capacity
        if self.options.cuda_graphs:  # every bucket's rows + the graphs' scratch row, without growing;
            slots = max(slots, self.options.graph_rows + 1)  # positions enough for a long segment
            capacity = max(capacity, GRAPH_KV_CAPACITY)  # (a reallocation re-captures every graph)
        self.kv = SlotKV(model.llm.llm.model.model, slots, capacity)
        self.graphs = self._decode_graphs()
        self.captured = self._captured_steps()
        self.budget = StepBudget(self.options.max_step_ms / 1000.0, self.options.step_clock)
        self._solves = itertools.count(1)  # numbers of flow chunks solved across units (`FlowChunk.solve`)
        # the vocoder's excitation draws: on the GPU in the GPU serving mode, on the host (the reference's
        # bit-for-bit stream) otherwise
        self._hift_draws_device = model.device if self.options.cuda_graphs else torch.device("cpu")
        self._active: dict[str, Utterance[Cv2State]] = {}  # diagnostics only (leak checks); never scheduled
        # memory admission: the utterances that may hold flow contexts now, and how many may (None: any)
        self._streaming: set[str] = set()
        self.streaming_cap: int | None = self.options.max_streaming or None
        self.stats = {
            "chunks": 0, "batches": 0, "batched_chunks": 0, "batch_fallbacks": 0,
            "decode_batches": 0, "decode_rows": 0, "decode_ahead": 0, "vocode_batches": 0,
        }  # fmt: skip
        text_normalize("warm up.", lambda s: [0] * len(s))  # loads the normaliser grammars now, not later
        self.text_prep = text_prep_for(model.text_frontend, self.options.text_workers)

    def bind_wake(self, wake: Callable[[], None]) -> None:
        """The worker's wake-up (any thread): a streamed token makes an utterance runnable."""
        self._wake = wake

    def _captured_steps(self) -> CapturedStages | None:
        """`cuda_graphs`: the flow estimator and HiFT's network as captured static-shape steps (the
        torch estimator only: an ONNX / TensorRT runner keeps its place); `static_steps`: the same path
        on a CPU, each step recorded once and replayed from its ops as a CUDA graph replays
        (`accel.tape`; a compiled step, which cannot be recorded, runs at each call)."""
        if not (self.options.cuda_graphs or self.options.static_steps):
            return None
        cuda = self.options.cuda_graphs and self.model.device.type == "cuda"
        capture: Capture = CudaCapture() if cuda else run_eagerly
        if not cuda and not self.options.compile_steps:
            capture = TapeCapture()
        return install_captured_steps(
            self.model,
            self.options.graph_rows,
            self.options.graph_memory_mb,
            capture,
            compile=self.options.compile_steps,
        )

    def _decode_graphs(self) -> DecodeGraphs | None:
        """`cuda_graphs`: the LLM's decode steps captured (CUDA); `static_decode`: the same static steps
        recorded and replayed from their ops on a CPU (`accel.tape`; CPU tests: the device sampling and
        decoding ahead run as on the GPU, the steps' Python not re-run)."""
        head, rows = self.model.llm.llm_decoder, self.options.graph_rows
        if self.options.static_decode and not self.options.cuda_graphs:
            return DecodeGraphs(self.kv, head, rows, capture=TapeCapture())
        if not self.options.cuda_graphs:
            return None
        if self.model.device.type != "cuda":
            raise ConfigError("engine.cuda_graphs: CUDA graphs need a CUDA device (engine.device)")
        return DecodeGraphs(self.kv, head, rows, compile=self.options.compile_steps)

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

    def prepare_clip(
        self, clip: Clip, transcript: str | None, voice_id: str | None = None, name: str = ""
    ) -> VoiceFeatures:
        """Any thread but the engine's: the clip's features, its transcript through the text pool."""
        prep = self.text_prep if isinstance(self.text_prep, ProcessTextPrep) else None
        return self.book.prepare(clip, transcript, voice_id, name, prep)

    def install_voice(self, prepared: object) -> InParts[dict[str, object]]:
        """Engine thread (an engine command in parts): the voice of `prepare_clip`'s features, its prompt
        caches built a part at a time between the other calls' units; its description. The id and the
        prompt are checked now, before any model work."""
        if not isinstance(prepared, VoiceFeatures):
            raise TypeError(f"not prepared voice features: {type(prepared).__name__}")
        return InParts(self._described(self.book.install_parts(prepared)))

    def _described(self, install: Parts[Voice]) -> Parts[dict[str, object]]:
        while True:
            with self.lane.compute():
                try:
                    next(install)
                except StopIteration as end:
                    voice: Voice = end.value
                    return voice.describe()
            yield

    def voice_infos(self) -> list[dict[str, object]]:
        return self.book.describe()

    def add_voice(self, voice: Voice, persist: bool = True) -> str:
        return self.book.add(voice, persist=persist).voice_id

    def delete_voice(self, voice_id: str) -> None:
        self.book.delete(voice_id)

    warm_up_prompt_ids: tuple[int, ...] = (0, 1, 2)  # the warm-up's one LLM step prefills these

    def warm_up(self) -> None:
        """Engine thread, before the engine reports ready: the captured stages' buckets (CUDA graphs),
        one LLM step and one flow + vocoder chunk on a prompt-free voice, so kernels, allocators and
        caches are set up before the first caller (both versions)."""
        started = time.perf_counter()
        bins, dim = self.model.flow.cfg.mel_bins, self.model.flow.cfg.spk_embed_dim
        voice = voice_from_features(
            self.model, torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, bins), torch.zeros(1, dim),
            voice_id="warm-up", kind="sft",
        )  # fmt: skip
        with self.lane.compute():
            if self.graphs is not None and self.options.cuda_graphs:
                self.graphs.warm()
            if self.captured is not None and self.options.cuda_graphs:
                dtype = next(self.model.flow.parameters()).dtype
                self.captured.warm(self.schedule, self.options.graph_warm_keys, self.model.device, dtype)
            slot = self.kv.acquire()
            try:  # (this step's first prefill and decode run the compiled steps too: before the seal)
                prompt = list(self.warm_up_prompt_ids)
                self.model.llm.step(self.model.llm.prefill(prompt, sampling="greedy", kv=slot))
            finally:
                slot.release()
            t2w = token2wav_stream(self.model, voice, self.schedule, pcm_to_host=self.lane.to_host)
            try:
                t2w.push([0] * (self.schedule.first_hop_tokens + self.schedule.lookahead_tokens))
                per_s = context_bytes_per_s(t2w.flow_state)
                t2w.finish()
            finally:
                t2w.release()
            for stage in (self.graphs, self.captured):  # compiled steps never compile while calls speak
                if stage is not None:
                    stage.seal()
        logger.info("%s warmed up in %.0f ms", self.name, 1000 * (time.perf_counter() - started))
        free = log_context_headroom(self.model.device, per_s)
        if not self.options.max_streaming and free is not None:
            self.streaming_cap = streaming_cap(free, per_s, self.options.streaming_context_s)
            logger.info(
                "memory admission: %d utterances stream at once (%.0f s of speech each); more wait",
                self.streaming_cap, self.options.streaming_context_s,
            )  # fmt: skip
        if self.captured is not None:
            self.captured.log_summary()

    # ---- BatchBackend protocol ----------------------------------------------------------------

    features = frozenset({"instruct", "speed"})  # speak options it honours (speed: without streaming)

    state_class: type[Cv2State] = Cv2State  # CosyVoice3: its own vocoder unit

    def llm_prompt(self, voice: Voice, instruct: str) -> LlmPrompt:
        """The LLM prompt parts of an utterance (`modes.llm_prompt`; CosyVoice3 adds `<|endofprompt|>`)."""
        return llm_prompt(voice, instruct, self.model.text_frontend.encode)

    def begin(self, utt: Utterance[Cv2State]) -> Cv2State:
        """The utterance's state: its voice, LLM prompt and seeded generators (shared by v2 and v3)."""
        voice = self.book.get(utt.voice)
        options = utt.options
        seed = self._seed(utt.utterance_id)
        self._active[utt.utterance_id] = utt
        return self.state_class(
            voice=voice,
            prompt=self.llm_prompt(voice, options.instruct),
            speed=options.speed if "speed" in self.features else 1.0,
            llm_generator=torch.Generator(self.model.device).manual_seed(seed),
            llm_seed=seed,
            hift_generator=torch.Generator(self._hift_draws_device).manual_seed(seed + 1),
            splitter=SentenceStream(words=self.options.bistream_unit == "word"),
        )

    def _seed(self, utterance_id: str) -> int:
        if self.options.seed is None:
            return int(torch.randint(0, 2**62, (1,)).item())
        return self.options.seed + zlib.crc32(utterance_id.encode())

    def plan(self, utt: Utterance[Cv2State], now_s: float) -> Work | None:
        st = utt.backend_state
        work = st.plan(utt) if st is not None else None
        if work is None or isinstance(work, VoicePrompt):  # building a voice holds no utterance context
            return work
        return work if self._admitted(utt) else None

    def _admitted(self, utt: Utterance[Cv2State]) -> bool:
        """Memory admission: an utterance holds flow contexts (every Euler step's K/V of every frame)
        from its first unit until it is released; while `streaming_cap` utterances do, another waits
        (planned again when one is released) instead of running the device out of memory."""
        uid = utt.utterance_id
        if uid in self._streaming:
            return True
        if self.streaming_cap is not None and len(self._streaming) >= self.streaming_cap:
            return False
        self._streaming.add(uid)
        return True

    @property
    def streaming(self) -> int:
        """Utterances admitted now (holding or about to hold flow contexts)."""
        return len(self._streaming)

    def wake_at(self, utt: Utterance[Cv2State]) -> float | None:
        return None  # only new text (a command) or our own progress makes work

    def run(self, batch: Sequence[Cv2Job], now_s: float) -> list[StepResult]:
        for job in batch:
            st = self._state(job)
            if st.started_s is None:
                st.started_s = now_s
                job.utt.add_metric("queue_wait_s", now_s - (job.utt.first_text_s or job.utt.opened_s))
        work = batch[0].work
        with self.lane.compute():
            if isinstance(work, Decode):
                return self._run_decode(batch)
            if isinstance(work, FlowChunk):
                return self._run_flow(batch)
            if isinstance(work, Vocode):
                return self._run_vocode(batch)
            if isinstance(work, VoicePrompt):
                return self._build_voice_prompts(batch)
            return [self._run_one(job) for job in batch]

    def step_alone(self, utt: Utterance[Cv2State], now_s: float) -> SynthStep | None:
        """Plan and run one unit of `utt` alone (benchmarks); None when it has nothing to do now."""
        work = self.plan(utt, now_s)
        if work is None:
            return None
        result = self.run([Job(utt, work)], now_s)[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def release(self, utt: Utterance[Cv2State]) -> None:
        self._active.pop(utt.utterance_id, None)
        if utt.backend_state is not None:
            utt.backend_state.release()
        utt.backend_state = None
        if utt.utterance_id in self._streaming:
            self._streaming.discard(utt.utterance_id)
            self._wake()  # an utterance waiting for admission may start now

    def captured_counts(self) -> dict[str, dict[str, int]]:
        """The captured stages' counts (/metrics): decode and prompt graphs, flow and vocoder steps."""
        counts = {}
        if self.graphs is not None:
            g = self.graphs
            counts["decode"] = {
                "replays": g.replays, "eager": 0, "captures": g.captures, "uncompiled": g.uncompiled,
                "launched_ahead": self.stats["decode_ahead"],  # launched before the step before was read
            }  # fmt: skip
            counts["prompt"] = {
                "replays": g.prompt_replays, "eager": g.prompt_eager, "captures": g.prompt_captures,
                "uncompiled": 0,
            }  # fmt: skip
        if self.captured is not None:
            for name, st in self.captured.stats().items():
                counts[name] = {
                    "replays": st.replays, "eager": st.eager, "captures": st.captures,
                    "uncompiled": st.uncompiled,
                }  # fmt: skip
        return counts

    def close(self) -> None:
        for utt in list(self._active.values()):
            self.release(utt)
        if self.captured is not None:
            self.captured.log_summary()
            remove_captured_steps(self.model, self.captured)
            self.captured = None
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        if self.streamer is not None:
            self.streamer.stop()
        self.text_prep.close()

    @staticmethod
    def _state(job: Cv2Job) -> Cv2State:
        st = job.utt.backend_state
        if st is None:
            raise RuntimeError(f"utterance {job.utt.utterance_id} has no state (released)")
        return st

    # ---- a voice's prompt caches at its first use ----------------------------------------------

    def _build_voice_prompts(self, batch: Sequence[Cv2Job]) -> list[StepResult]:
        """Parts of the batch's voices' prompt caches while another fits in the budget (at least one
        each); utterances of one voice share its build, and a failed build fails them all."""
        clock = self.budget.start()
        errors: dict[int, BaseException] = {}
        builds: dict[int, list[int]] = {}  # id(caches) -> the batch rows of that voice
        for i, job in enumerate(batch):
            builds.setdefault(id(self._state(job).voice.caches), []).append(i)
        started = time.perf_counter()
        for rows in builds.values():
            caches = self._state(batch[rows[0]]).voice.caches
            try:
                while not caches.advance() and clock.another():
                    pass
            except Exception as exc:  # noqa: BLE001 - the utterances of this voice only
                errors.update((i, exc) for i in rows)
        share = (time.perf_counter() - started) / len(batch)
        for job in batch:
            job.utt.add_metric("voice_prompt_s", share)
        return [errors.get(i, SynthStep(sample_rate_hz=SAMPLE_RATE_HZ)) for i in range(len(batch))]

    # ---- one-at-a-time units: frontend, segment start, the end ---------------------------------

    def _run_one(self, job: Cv2Job) -> StepResult:
        try:
            st, work = self._state(job), job.work
            if isinstance(work, Frontend):
                self._frontend(job.utt, st)
            elif isinstance(work, Prefill):
                text = self._start_segment(job.utt.utterance_id, st)
                return SynthStep(sample_rate_hz=SAMPLE_RATE_HZ, text=text)  # marks where its audio starts
            elif isinstance(work, Finish):
                st.release()
                return SynthStep(sample_rate_hz=SAMPLE_RATE_HZ, done=True)
            else:
                raise TypeError(f"unexpected unit {work!r}")
            return SynthStep(sample_rate_hz=SAMPLE_RATE_HZ)
        except Exception as exc:  # noqa: BLE001 - isolated per utterance
            return exc

    def _frontend(self, utt: Utterance[Cv2State], st: Cv2State) -> None:
        """Hand new text to the preparation pool and install what it sent back (`voice/text_prep.py`;
        with `text_workers` > 0 the engine thread never normalises or tokenises text itself)."""
        started = time.perf_counter()
        texts = st.take_text(utt)
        if st.mode == "whole" and st.segments is None:
            st.segments, st.segment_texts = deque(), deque()
        elif st.mode == "deltas" and st.bistream is None:
            st.bistream = BistreamSession.start(
                self.model.llm, st.prompt.text_ids, st.prompt.speech_ids,
                sampling=self.options.sampling, generator=st.llm_generator, kv=self.kv.acquire(),
            )  # fmt: skip
            st.t2w = self._open_t2w(st)
        for text in texts:
            chunks = prep_chunks(text, self.options.prep_chars)
            if chunks and st.mode == "deltas" and text[:1].isspace():
                chunks[0] = " " + chunks[0]  # a piece after a space keeps it: its tokens are as written
            st.pending.waiting.extend((c, st.mode == "whole") for c in chunks)
        self._pump_text(utt, st)
        if st.mode == "deltas" and utt.input_ended and not st.text_ended and not st.pending.busy:
            assert st.bistream is not None
            st.bistream.end_text()
            st.text_ended = True
        utt.add_metric("frontend_s", time.perf_counter() - started)

    def _pump_text(self, utt: Utterance[Cv2State], st: Cv2State) -> None:
        """Submit the next preparation job if none is in flight, and install it once finished: one job
        per unit (run inline, a job is then one bounded step) and one in flight per utterance, so
        utterances sharing the pool take turns."""
        pending = st.pending
        if pending.inflight is None and pending.waiting:
            text, split = pending.waiting.popleft()
            pending.inflight = self.text_prep.submit(text, split)
            if not pending.inflight.done():
                pending.inflight.add_done_callback(lambda _done: self._wake())
        if pending.inflight is None or not pending.inflight.done():
            return
        prepared = pending.take()
        if prepared.fell_back:
            logger.warning("utterance %s: text normalisation failed; using the raw text", utt.utterance_id)
        utt.add_metric("text_prep_cpu_s", prepared.cpu_s)
        for text, ids in prepared.pieces:
            if st.mode == "whole":
                assert st.segments is not None and st.segment_texts is not None
                st.segments.append(list(ids))
                st.segment_texts.append(text)
            elif st.bistream is not None:
                st.bistream.push_text(list(ids))

    def _normalize(self, utt: Utterance[Cv2State], text: str, split: bool) -> list[str]:
        """The official normalisation (+ split); text with nothing to say gives no pieces."""
        if not has_speech(text):
            return []
        try:
            return text_normalize(text, self.model.text_frontend.encode, split=split)
        except Exception:  # noqa: BLE001 - wetext asserts on some inputs: speak the raw text instead
            logger.warning("utterance %s: text normalisation failed; using the raw text", utt.utterance_id)
            return [text.strip()]

    def _open_t2w(self, st: Cv2State) -> Token2WavStream:
        speed: dict[str, float | int] = {}  # only streams that honour it get it
        if st.speed != 1.0:
            speed = {"speed": st.speed, "speed_window_tokens": self.options.speed_window_tokens}
        return token2wav_stream(
            self.model,
            st.voice,
            self.schedule,
            generator=st.hift_generator,
            pcm_to_host=self.lane.to_host,
            **speed,
        )

    def _start_segment(self, utterance_id: str, st: Cv2State) -> str:
        """Prefill the next segment's LLM (or hand it to the streamer); returns its text (what its audio
        will say)."""
        assert st.segments
        st.end_llm()
        if st.t2w is not None:
            st.t2w.release()
        voice = st.voice
        text_ids = st.segments.popleft()
        st.segments_started += 1
        if self.streamer is not None:
            st.llm = self._stream_segment(f"{utterance_id}/{st.segments_started}", st, text_ids)
        else:
            st.llm = self.model.llm.prefill(
                text_ids, st.prompt.text_ids, st.prompt.speech_ids,
                sampling=self.options.sampling, generator=st.llm_generator,
                prefix=voice.prefix if st.prompt.text_ids == voice.prefix.prompt_text_tokens else None,
                kv=self.kv.acquire(),
            )  # fmt: skip
            if self.options.max_segment_tokens is not None:
                st.llm.max_len = min(st.llm.max_len, self.options.max_segment_tokens)
        st.llm_steps = 0
        st.t2w = self._open_t2w(st)
        return st.segment_texts.popleft() if st.segment_texts else ""

    def _stream_segment(self, request_id: str, st: Cv2State, text_ids: list[int]) -> StreamedSession:
        """Submit one segment to the streamer: its prompt embeddings and the length rules of `prefill`."""
        assert self.streamer is not None
        n_text = len(text_ids)
        max_len = int(n_text * MAX_TOKEN_TEXT_RATIO)
        if self.options.max_segment_tokens is not None:
            max_len = min(max_len, self.options.max_segment_tokens)
        embeds = self.model.llm.lm_input(text_ids, st.prompt.text_ids, st.prompt.speech_ids)[0]
        session = StreamedSession(
            request_id, self.streamer, int(n_text * MIN_TOKEN_TEXT_RATIO), max_len, wake=self._wake
        )
        seed = st.llm_seed + st.segments_started - 1
        self.streamer.submit(request_id, embeds, session.min_len, max_len, session.push, seed=seed)
        return session

    # ---- LLM decode, batched across utterances ------------------------------------------------

    def _run_decode(self, batch: Sequence[Cv2Job]) -> list[StepResult]:
        """Up to `decode_burst` batched LLM steps; a row leaves when its chunk is ready or it must wait.
        Streamed rows take what their streamer sent (no model work) and leave when it is used up."""
        errors: dict[int, BaseException] = {}
        active = list(range(len(batch)))
        clock = self.budget.start()
        ahead = DecodeAhead() if self.graphs is not None and self.options.decode_ahead else None
        for _ in range(self.options.decode_burst):
            local: list[int] = []
            prompts: list[int] = []
            still: list[int] = []
            for i in active:
                st = self._state(batch[i])
                if isinstance(st.llm, StreamedSession):
                    try:
                        took, token = st.llm.take()
                    except Exception as exc:  # noqa: BLE001 - the streamer failed this utterance only
                        errors[i] = exc
                        continue
                    if took and self._took_token(batch[i].utt, st, token, 0.0, time.perf_counter()):
                        still.append(i)
                elif self._prefills_in_parts(st):
                    prompts.append(i)
                else:
                    local.append(i)
            if local:
                still += self._decode_local(batch, local, errors, ahead)
            for i in prompts:  # after the decode rows: a prompt's parts take what is left of the budget
                st = self._state(batch[i])
                try:
                    fed, token = self._prefill_part(batch[i].utt, st, clock)
                except Exception as exc:  # noqa: BLE001 - this utterance's prompt only
                    errors[i] = exc
                    continue
                if fed:  # its first token: it decodes on from the next unit (the prompt used this one)
                    self._took_token(batch[i].utt, st, token, 0.0, time.perf_counter())
            active = sorted(still)
            if not active or not clock.another():
                break
        if ahead is not None and ahead.launched is not None:  # the last step launched: read it now
            self._read_ahead(batch, ahead, errors)
        return [errors.get(i, SynthStep(sample_rate_hz=SAMPLE_RATE_HZ)) for i in range(len(batch))]

    def _prefills_in_parts(self, st: Cv2State) -> bool:
        """The prompt goes one decoder layer per part under the step budget (a CPU prompt of a few
        hundred positions is a whole unit's budget several times over); captured decode (a GPU) and
        bistream text segments feed in one forward."""
        if st.prefill_parts is not None:
            return True
        session = st.llm
        return (
            self.budget.budget_s > 0
            and self.graphs is None
            and isinstance(session, LlmSession)
            and isinstance(session.cache, KVSlot)
            and not session.finished
            and session.pending is not None
            and session.pending.shape[1] > 1
        )

    def _prefill_part(
        self, utt: Utterance[Cv2State], st: Cv2State, clock: UnitClock
    ) -> tuple[bool, int | None]:
        """Decoder layers of `st`'s prompt while another fits in the budget (at least one); once the
        last is done, the first token as `decode_batch` draws it: (True, token), else (False, None)."""
        session = st.llm
        assert isinstance(session, LlmSession) and isinstance(session.cache, KVSlot)
        started = time.perf_counter()
        with torch.inference_mode():
            if st.prefill_parts is None:
                prompt, session.pending = session.pending, None
                assert prompt is not None
                st.prefill_parts = session.cache.pool.forward_parts([session.cache], prompt)
            while True:
                try:
                    next(st.prefill_parts)
                except StopIteration as end:
                    st.prefill_parts = None
                    session.logits = self.model.llm.llm_decoder(end.value[0, -1])
                    token = self.model.llm.accept(session)
                    break
                if not clock.another():
                    utt.add_metric("llm_prefill_s", time.perf_counter() - started)
                    return False, None
        utt.add_metric("llm_prefill_s", time.perf_counter() - started)
        return True, token

    def _decode_local(
        self,
        batch: Sequence[Cv2Job],
        rows: list[int],
        errors: dict[int, BaseException],
        ahead: DecodeAhead | None = None,
    ) -> list[int]:
        """One batched step of the rows decoding on this thread; the rows that may go on. With `ahead`
        (the decode graphs) the plain sessions' step is launched before the step before is read."""
        sessions: list[LlmSession | BistreamSession] = []
        for i in rows:
            st = self._state(batch[i])
            session = st.llm if st.llm is not None else st.bistream
            assert session is not None and not isinstance(session, StreamedSession)
            sessions.append(session)
        still: list[int] = []
        if ahead is not None:  # the plain sessions on the graphs' pool never take the step-by-step path:
            assert self.graphs is not None  # one at max_len with its last token unread launches nothing
            owned = [(i, s) for i, s in zip(rows, sessions, strict=True) if ahead.owns(s, self.graphs)]
            launching = [i for i, s in owned if isinstance(s, LlmSession) and can_launch(s, self.graphs)]
            still += self._launch_ahead(batch, launching, errors, ahead)
            kept = [(i, s) for i, s in zip(rows, sessions, strict=True) if i not in dict(owned)]
            rows, sessions = [i for i, _ in kept], [s for _, s in kept]
            if not rows:
                return still
        started = time.perf_counter()
        tokens = decode_batch(self.model.llm, sessions, self.graphs)
        now = time.perf_counter()
        self.stats["decode_batches"] += 1
        self.stats["decode_rows"] += len(rows)
        share = (now - started) / len(rows)
        for i, token in zip(rows, tokens, strict=True):
            if isinstance(token, BaseException):
                errors[i] = token
            elif self._took_token(batch[i].utt, self._state(batch[i]), token, share, now):
                still.append(i)
        return still

    def _launch_ahead(
        self, batch: Sequence[Cv2Job], rows: list[int], errors: dict[int, BaseException], ahead: DecodeAhead
    ) -> list[int]:
        """Launch a step of `rows` (plain sessions on the decode graphs' pool), then read the step launched
        before (`llm.ahead`); the launched rows that may go on: those whose read token let them."""
        assert self.graphs is not None
        before = ahead.launched
        ahead.launched = None
        self.stats["decode_ahead"] += bool(rows) and before is not None  # launched behind a step in flight
        if rows:
            sessions = [self._plain(batch[i]) for i in rows]
            ahead.row_of.update((id(session), i) for session, i in zip(sessions, rows, strict=True))
            try:
                ahead.launched = launch(self.model.llm, self.graphs, sessions, before)
            except Exception as exc:  # noqa: BLE001 - the rows of this step fail together
                for i in rows:
                    errors[i] = exc
                rows = []
        stopped = self._read_ahead(batch, ahead, errors, before) if before is not None else set()
        return [i for i in rows if i not in stopped and i not in errors]

    def _read_ahead(
        self,
        batch: Sequence[Cv2Job],
        ahead: DecodeAhead,
        errors: dict[int, BaseException],
        step: DecodeLaunch | None = None,
    ) -> set[int]:
        """Read a launched step (default: the last) and account its tokens; the rows it stopped (ended,
        chunk ready, or failed): they launch no more steps in this unit."""
        if step is None:
            step, ahead.launched = ahead.launched, None
        assert step is not None
        rows = [ahead.row_of[id(s)] for s in step.sessions]
        try:
            tokens = read(self.model.llm, step)
        except Exception as exc:  # noqa: BLE001 - the rows of this step fail together
            for i in rows:
                errors[i] = exc
            return set(rows)
        now = time.perf_counter()
        self.stats["decode_batches"] += 1
        self.stats["decode_rows"] += len(rows)
        share, ahead.read_at_s = (now - ahead.read_at_s) / len(rows), now
        stopped = set()
        for i, token in zip(rows, tokens, strict=True):
            if token == DROPPED:
                stopped.add(i)
            elif not self._took_token(batch[i].utt, self._state(batch[i]), token, share, now):
                stopped.add(i)
        return stopped

    def _plain(self, job: Cv2Job) -> LlmSession:
        session = self._state(job).llm
        assert isinstance(session, LlmSession)
        return session

    def _took_token(
        self, utt: Utterance[Cv2State], st: Cv2State, token: int | None, share_s: float, now: float
    ) -> bool:
        """Account one decode step of `utt`; True if it may decode again in this burst."""
        assert st.t2w is not None
        prefill = st.llm_steps == 0
        st.llm_steps += 1
        utt.add_metric("llm_prefill_s" if prefill else "llm_decode_s", share_s)
        if prefill and st.first_hop_at_s is None:
            st.first_hop_at_s = now
        cap = self.options.max_segment_tokens
        if st.bistream is not None and cap is not None and len(st.t2w.tokens) + 1 >= cap:
            st.bistream.finished = True
        if token is not None:
            st.t2w.add_tokens([token])
        session = st.llm if st.llm is not None else st.bistream
        llm_over = session is not None and session.finished
        if llm_over and session is not None and isinstance(session.cache, KVSlot):
            session.cache.release()  # the slot is free for another utterance now
        if st.t2w.ready():
            self._note_first_hop(utt, st)
            return False
        return not llm_over and not (st.bistream is not None and st.bistream.needs_text)

    def _note_first_hop(self, utt: Utterance[Cv2State], st: Cv2State) -> None:
        if not st.first_hop_recorded and st.first_hop_at_s is not None:
            st.first_hop_recorded = True
            utt.add_metric("decode_first_hop_s", time.perf_counter() - st.first_hop_at_s)

    # ---- flow, batched across utterances of equal advance -------------------------------------

    def _run_flow(self, batch: Sequence[Cv2Job]) -> list[StepResult]:
        size = max(1, self.options.flow_batch_rows or len(batch))
        results: list[StepResult] = []
        for start in range(0, len(batch), size):
            results.extend(self._flow_group(batch[start : start + size]))
        return results

    def _flow_group(self, group: Sequence[Cv2Job]) -> list[StepResult]:
        work = group[0].work
        assert isinstance(work, FlowChunk)
        if work.solve:
            return self._continue_flow(group)
        whole = (work.final and self.schedule.final_chunk == "reference") or any(
            self._state(j).speed != 1.0 for j in group
        )  # the reference's full-attention last call, or a window of a non-streaming (speed) segment
        if whole and len(group) > 1:
            return [r for job in group for r in self._flow_group([job])]  # a whole-utterance recompute each
        try:
            t2ws = [self._t2w(job) for job in group]
            plans = [t2w.plan(final=work.final) for t2w in t2ws]
            flow_states = [_flow_state(job, t2w) for job, t2w in zip(group, t2ws, strict=True)]
        except Exception as exc:  # noqa: BLE001 - a broken state: fail the members one by one
            if len(group) == 1:
                return [exc]
            return [r for job in group for r in self._flow_group([job])]
        ready = [p for p in plans if p is not None]
        saved: list[FlowStreamState] = []  # each member's state before the chunk: a retry's start
        started = time.perf_counter()
        try:
            if len(ready) != len(plans):
                raise RuntimeError("flow chunk planned but not ready")
            if whole:
                return self._window_part(group[0], t2ws[0], ready[0], started)
            tokens = [p.new_tokens for p in ready]
            if len(group) > 1:  # room first: the saved shares then hold the grown contexts, not the old
                self.model.flow.reserve_stream(tokens, flow_states, work.final)
                saved = [state.clone() for state in flow_states]
            clock = self.budget.start()  # the encoder's share counts too
            stream = self.model.flow.start_stream_batch(tokens, flow_states, work.final)
            mels = self._advance_flow(stream, clock)
        except Exception as exc:  # noqa: BLE001 - retried alone below (or the lone member fails)
            if len(group) == 1:
                return [exc]
            logger.warning("batched flow step failed; retrying its %d utterances one by one", len(group))
            self.stats["batch_fallbacks"] += 1
            if saved:  # (none: the failure came before the states changed)
                for t2w, state in zip(t2ws, saved, strict=True):
                    t2w.flow_state = state
            return [r for job in group for r in self._flow_group([job])]
        members = [(self._state(job), t2w, plan) for job, t2w, plan in zip(group, t2ws, ready, strict=True)]
        pending = PendingFlow(next(self._solves), stream, members, saved, time.perf_counter() - started)
        if mels is None:  # the rest of its Euler steps in the next units
            for st, _, _ in members:
                st.flow_solve = pending
        else:
            self._hand_out(pending, mels)
        return [SynthStep(sample_rate_hz=SAMPLE_RATE_HZ) for _ in group]

    def _advance_flow(self, stream: StreamSolve, clock: UnitClock) -> list[Tensor] | None:
        """Parts of `stream` (estimator stages; whole Euler steps on a runner) while another fits in
        this unit's budget (at least one)."""
        while True:
            mels = self.model.flow.advance_stream(stream, parts=1)
            if mels is not None or not clock.another():
                return mels

    def _continue_flow(self, group: Sequence[Cv2Job]) -> list[StepResult]:
        """The next Euler steps of a started chunk (`group` holds some or all of its members)."""
        pending = self._state(group[0]).flow_solve
        if pending is None or any(self._state(job).flow_solve is not pending for job in group):
            return [RuntimeError("a flow chunk continued without its started batch") for _ in group]
        started = time.perf_counter()
        try:
            mels = self._advance_flow(pending.stream, self.budget.start())
        except Exception as exc:  # noqa: BLE001 - every member starts its chunk again (or the lone one fails)
            return self._restart_flow(pending, group, exc)
        pending.flow_s += time.perf_counter() - started
        if mels is not None:
            self._hand_out(pending, mels)
        return [SynthStep(sample_rate_hz=SAMPLE_RATE_HZ) for _ in group]

    def _hand_out(self, pending: PendingFlow, mels: list[Tensor]) -> None:
        """A solved chunk's mel to each member still holding its stream."""
        rows = len(pending.members)
        if rows > 1:
            self.stats["batches"] += 1
            self.stats["batched_chunks"] += rows
        for (st, t2w, plan), mel in zip(pending.members, mels, strict=True):
            if st.done or st.t2w is not t2w:
                continue  # released while its chunk was being solved
            st.flow_solve = None
            st.flowed = FlowedChunk(plan, mel, pending.flow_s / rows)

    def _restart_flow(
        self, pending: PendingFlow, group: Sequence[Cv2Job], exc: Exception
    ) -> list[StepResult]:
        live = [(st, t2w) for st, t2w, _ in pending.members if st.flow_solve is pending]
        for st, _ in live:
            st.flow_solve = None
        if not pending.saved:
            return [exc for _ in group]  # the lone member fails
        logger.warning("batched flow step failed; its %d utterances start the chunk again", len(live))
        self.stats["batch_fallbacks"] += 1
        for (st, t2w, _), state in zip(pending.members, pending.saved, strict=True):
            if st.t2w is t2w and not st.done:
                t2w.flow_state = state
        return [r for job in group for r in self._flow_group([Job(job.utt, replace(job.work, solve=0))])]  # type: ignore[arg-type]

    def _window_part(
        self, job: Cv2Job, t2w: Token2WavStream, plan: ChunkPlan, started: float
    ) -> list[StepResult]:
        """A bounded part of a full-attention flow call: its estimator parts while another fits in the
        budget (`WINDOW_EULER_STEPS` Euler steps without one); its mel at the end."""
        st = self._state(job)
        clock = self.budget.start()
        if clock.budget_s <= 0:
            mel = t2w.flow_mel_part(plan, euler_steps=WINDOW_EULER_STEPS)
        else:
            while (mel := t2w.flow_mel_part(plan, None, parts=1)) is None and clock.another():
                pass
        st.window_flow_s += time.perf_counter() - started
        if mel is not None:  # solved: a speed window's long mel goes to the vocoder in pieces
            pieces = None if t2w.streaming else self.vocoder_piece_frames
            st.flowed = FlowedChunk(plan, mel, st.window_flow_s, pieces)
            st.window_flow_s = 0.0
        return [SynthStep(sample_rate_hz=SAMPLE_RATE_HZ)]

    @property
    def vocoder_piece_frames(self) -> int:
        """A speed window's mel goes to the vocoder in pieces no longer than a streaming chunk's."""
        hop = self.schedule.max_hop_tokens + self.schedule.lookahead_tokens
        return self.model.flow.cfg.token_mel_ratio * hop

    def _t2w(self, job: Cv2Job) -> Token2WavStream:
        t2w = self._state(job).t2w
        if t2w is None or t2w.flow_state is None:
            raise RuntimeError(f"utterance {job.utt.utterance_id}: no token2wav stream")
        return t2w

    # ---- vocoder ------------------------------------------------------------------------------

    def _run_vocode(self, batch: Sequence[Cv2Job]) -> list[StepResult]:
        """HiFT for every row in one forward (the scheduler batched equal vocoder lengths); if the batch
        fails, each row is retried alone (its HiFT state is only written once its own row succeeded).
        Under `[engine] max_step_ms` (eager HiFT) the forward goes in parts across units (`PendingVocode`)."""
        work = batch[0].work
        assert isinstance(work, Vocode)
        if work.solve:
            return self._continue_vocode(batch)
        try:
            states = [self._state(job) for job in batch]
            t2ws = [st.t2w for st in states]
            if any(st.flowed is None for st in states) or any(t is None for t in t2ws):
                raise RuntimeError("vocoder unit planned without a flowed chunk")
            pieces = [st.flowed.next_piece(t2w.emitted_tokens) for st, t2w in zip(states, t2ws, strict=True)]  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - isolated per utterance
            return self._vocode_alone(batch) if len(batch) > 1 else [exc]
        saved = [hift_snapshot(t) for t in t2ws]  # type: ignore[arg-type]
        args = (
            t2ws,
            [plan for plan, _, _ in pieces],
            [mel for _, mel, _ in pieces],
            [st.flowed.flow_s for st in states],  # type: ignore[union-attr]
        )
        try:
            if self.budget.budget_s > 0 and self.model.hift.decode_runner is None:
                members = [
                    (st, t2w, rest) for st, t2w, (_, _, rest) in zip(states, t2ws, pieces, strict=True)
                ]
                parts = vocode_batch_parts(*args, to_host=self.lane.to_host_async)  # type: ignore[arg-type]
                pending = PendingVocode(next(self._solves), parts, members, saved, work.frames, work.final)  # type: ignore[arg-type]
                chunks = self._advance_vocode(pending, self.budget.start())
                if chunks is None:  # the rest of its parts in the next units
                    for st in states:
                        st.vocode_solve = pending
                    return [SynthStep(sample_rate_hz=SAMPLE_RATE_HZ) for _ in batch]
            else:
                chunks = vocode_batch(*args, to_host=self.lane.to_host_async)  # type: ignore[arg-type]
                self.stats["vocode_batches"] += 1
        except Exception as exc:  # noqa: BLE001 - retried alone below (or the lone row fails)
            if len(batch) == 1:
                return [exc]
            logger.warning("batched vocoder step failed; retrying its %d utterances one by one", len(batch))
            for t2w, snapshot in zip(t2ws, saved, strict=True):
                hift_restore(t2w, snapshot)  # type: ignore[arg-type]
            return self._vocode_alone(batch)
        results: list[StepResult] = []
        for job, st, chunk, (_, _, rest) in zip(batch, states, chunks, pieces, strict=True):
            st.flowed = rest
            results.append(self._vocoded(job, chunk))
        return results

    def _vocoded(self, job: Cv2Job, chunk: Chunk) -> SynthStep:
        self._account(job.utt, chunk)
        return SynthStep(pcm=[chunk.pcm] if chunk.pcm.size else [], sample_rate_hz=SAMPLE_RATE_HZ)

    def _advance_vocode(self, pending: PendingVocode, clock: UnitClock) -> list[Chunk] | None:
        """Parts of `pending` (the excitation, then HiFT's upsampling stages) while another fits in this
        unit's budget (at least one); its chunks at the end."""
        with torch.inference_mode():
            while True:
                try:
                    next(pending.parts)
                except StopIteration as end:
                    chunks: list[Chunk] = end.value
                    pending.chunks = chunks
                    self.stats["vocode_batches"] += 1
                    return chunks
                if not clock.another():
                    return None

    def _continue_vocode(self, group: Sequence[Cv2Job]) -> list[StepResult]:
        """The next parts of a started vocoder batch (`group` holds some or all of its members); once it
        is done, each member's chunk (a member not in the last unit takes its chunk in its next one)."""
        pending = self._state(group[0]).vocode_solve
        if pending is None or any(self._state(job).vocode_solve is not pending for job in group):
            return [RuntimeError("a vocoder step continued without its started batch") for _ in group]
        if pending.chunks is None:
            try:
                if self._advance_vocode(pending, self.budget.start()) is None:
                    return [SynthStep(sample_rate_hz=SAMPLE_RATE_HZ) for _ in group]
            except Exception as exc:  # noqa: BLE001 - every member starts its step again (or the lone one fails)
                return self._restart_vocode(pending, group, exc)
        assert pending.chunks is not None
        results: list[StepResult] = []
        for job in group:
            st = self._state(job)
            row = next(i for i, (member, _, _) in enumerate(pending.members) if member is st)
            st.vocode_solve = None
            st.flowed = pending.members[row][2]
            results.append(self._vocoded(job, pending.chunks[row]))
        return results

    def _restart_vocode(
        self, pending: PendingVocode, group: Sequence[Cv2Job], exc: Exception
    ) -> list[StepResult]:
        for (st, t2w, _), snapshot in zip(pending.members, pending.saved, strict=True):
            if st.vocode_solve is pending:
                st.vocode_solve = None
                hift_restore(t2w, snapshot)
        if len(pending.members) == 1:
            return [exc for _ in group]  # the lone member fails
        logger.warning("batched vocoder step failed; its utterances vocode their chunks again alone")
        self.stats["batch_fallbacks"] += 1
        return [r for job in group for r in self._run_vocode([Job(job.utt, replace(job.work, solve=0))])]  # type: ignore[arg-type]

    def _vocode_alone(self, batch: Sequence[Cv2Job]) -> list[StepResult]:
        return [r for job in batch for r in self._run_vocode([job])]

    def _account(self, utt: Utterance[Cv2State], chunk: Chunk) -> Chunk:
        utt.add_metric("flow_s", chunk.flow_s)
        utt.add_metric("vocoder_s", chunk.vocoder_s)
        self.stats["chunks"] += 1
        return chunk


MEL_FRAMES_PER_S = 50


def context_bytes_per_s(state: FlowStreamState | None) -> float:
    """Bytes of flow context one utterance holds per second of its speech (every Euler step keeps its
    own K/V of every frame so far: exact streaming's price; 0 when nothing is cached yet)."""
    if state is None or not state.frames:
        return 0.0
    return state.cache_bytes() / state.frames * MEL_FRAMES_PER_S


ADMISSION_HEADROOM = 0.15  # of the memory free after warm-up, kept for activations and allocator slack


ROOM_GROWTH = 1.25  # a packed context's room: at most a quarter past its frames, plus `GROW_FRAMES`


def streaming_cap(free_bytes: float, per_s: float, context_s: float) -> int:
    """How many utterances may hold flow contexts at once: the memory free after warm-up, less
    `ADMISSION_HEADROOM`, over the room `context_s` seconds of speech take each (the frames' bytes, a
    quarter more and `GROW_FRAMES` frames: what `PackedCache` may allocate for them), at least 1. Pure."""
    if per_s <= 0 or context_s <= 0:
        raise ValueError("streaming_cap needs positive bytes per second and seconds per utterance")
    room_s = context_s * ROOM_GROWTH + GROW_FRAMES / MEL_FRAMES_PER_S
    return max(1, int(free_bytes * (1.0 - ADMISSION_HEADROOM) / (per_s * room_s)))


def log_context_headroom(device: torch.device, per_s: float) -> int | None:
    """On a GPU, how much speech can be in flight at once: the flow contexts, not compute, bound how
    many utterances stream together. The free bytes (None off a GPU)."""
    if device.type != "cuda" or per_s <= 0:
        return None
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # the allocator's spare
    logger.info(
        "flow context: %.1f MB per second of speech per utterance; %.1f GB free after warm-up: about %.0f s "
        "of speech in flight at once (%d utterances of 10 s)",
        per_s / 2**20, free / 2**30, free / per_s, int(free / per_s / 10),
    )  # fmt: skip
    return int(free)


def _flow_state(job: Cv2Job, t2w: Token2WavStream) -> FlowStreamState:
    if t2w.flow_state is None:
        raise RuntimeError(f"utterance {job.utt.utterance_id}: no flow state")
    return t2w.flow_state


def hift_snapshot(t2w: Token2WavStream) -> HiftSnapshot:
    """What a vocoder step may change: the HiFT stream state and the excitation's random generator (a
    step retried after a failure draws the same excitation, so it makes the same audio)."""
    state = t2w.hift_state
    rng = t2w.generator.get_state() if t2w.generator is not None else None
    return HiftSnapshot(None if state is None else replace(state), rng)


def hift_restore(t2w: Token2WavStream, snapshot: HiftSnapshot) -> None:
    if snapshot.state is not None and t2w.hift_state is not None:
        t2w.hift_state.__dict__.update(snapshot.state.__dict__)
        t2w.finished = False
    if snapshot.rng is not None and t2w.generator is not None:
        t2w.generator.set_state(snapshot.rng)


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


def llm_streamer(model: CosyVoice2Model, engine: EngineConfig) -> SpeechTokenStreamer | None:
    """`[engine] llm`: None (torch, on the engine thread), our LLM on its own thread, or vLLM (CUDA)."""
    if engine.llm == "thread":  # with cuda_graphs: its own decode graphs and CUDA stream, decoding ahead
        graphs = engine.cuda_graphs and model.device.type == "cuda"
        return ThreadedSpeechLlm(model.llm, slots=engine.max_batch, graphs=graphs)
    if engine.llm == "vllm":
        if model.device.type != "cuda":
            raise ConfigError("engine.llm: vllm needs a CUDA device (engine.device)")
        from voicertc.backends.cosyvoice.llm.vllm.runner import VllmSpeechLlm

        # vLLM's attention backends serve half precision; fp32 would fall back to a slow one
        dtype = "bfloat16" if engine.dtype == "float32" else engine.dtype
        if dtype != engine.dtype:
            logger.info("engine.llm = vllm: the speech LLM runs in bfloat16 on vLLM")
        path = str(vllm_export_dir(engine))
        return VllmSpeechLlm(path, dtype=dtype, ras=model.llm.sampling_params)
    return None


def backend_options(config: Config) -> BackendOptions:
    """The `[engine]` / `[limits]` keys a CosyVoice backend (v2 or v3) takes from config.toml."""
    engine = config.engine
    return BackendOptions(
        cuda_graphs=engine.cuda_graphs,
        compile_steps=engine.compile and engine.cuda_graphs,
        graph_rows=engine.max_batch,
        graph_memory_mb=engine.graph_memory_mb,
        max_segment_tokens=config.limits.max_speech_tokens_per_segment,
        text_workers=engine.text_workers,
        bistream_unit=engine.bistream_unit,
        max_step_ms=engine.max_step_ms,
        max_streaming=engine.max_streaming,
        streaming_context_s=engine.streaming_context_s,
    )


def create_backend(config: Config) -> CosyVoice2Backend:
    """Load `config.engine.model_dir` on the configured device and wrap it as the engine backend."""
    engine = config.engine
    device = resolve_device(engine.device)
    dtype = torch_dtype(engine.dtype, device)  # CPU: float32, or bfloat16 when asked
    model = load(engine.model_dir, device, dtype)
    apply_accel(model, engine)  # [engine] estimator / compile / llm (nothing for the fp32 eager default)
    s = config.schedule
    schedule = ChunkSchedule(
        first_hop_tokens=s.first_hop_tokens,
        growth=s.growth,
        max_hop_tokens=s.max_hop_tokens,
        lookahead_tokens=s.lookahead_tokens,
        grid_tokens=s.grid_tokens or None,
        final_chunk=s.final_chunk,  # type: ignore[arg-type]
    )
    streamer = llm_streamer(model, engine)
    backend = CosyVoice2Backend(model, schedule, engine.voices_dir or None, backend_options(config), streamer)
    if streamer is not None:
        streamer.start()
    backend.warm_up()
    return backend
