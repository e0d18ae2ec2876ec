"""CosyVoice3Backend: the `cosyvoice3` engine, CosyVoice2's backend with v3's model, prompts and vocoder.

Everything the engine core sees is CosyVoice2's (`CosyVoice2Backend`: the batched LLM decode on the slot
KV cache, the batched flow estimator, the per-utterance state and its pure `plan`). What differs:
* the model (`cosyvoice3.load`) and its token2wav stream (incremental causal HiFT);
* the LLM prompt: CosyVoice3 needs `<|endofprompt|>`; voices without a transcript (cross-lingual, sft)
  get "You are a helpful assistant.<|endofprompt|>" as prompt text, instruct2 puts the instruction
  before it (as upstream's examples do);
* text arriving as deltas: one bistream session with v3's ids and prompt layout (`llm.bistream`: the
  prompt text up to `<|endofprompt|>` is fed whole after sos, the rest mixed 5 text : 15 speech);
* vocoding: the incremental causal HiFT; rows whose streams are in one phase (same chunk length, same
  carried shapes: `hift.causal_batch.phase_key`) run as one forward, the others alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from voicertc.backends.cosyvoice.flow.dit import use_matmul_convs
from voicertc.backends.cosyvoice.llm.v3 import ENDOFPROMPT_ID
from voicertc.backends.cosyvoice.load import load_v3 as load
from voicertc.backends.cosyvoice.load.files import torch_dtype
from voicertc.backends.cosyvoice.load.v3 import CosyVoice3Model
from voicertc.backends.cosyvoice.serve.backend import (
    SAMPLE_RATE_HZ,
    CosyVoice2Backend,
    Cv2Job,
    backend_options,
    hift_snapshot,
)
from voicertc.backends.cosyvoice.serve.device_lane import resolve_device
from voicertc.backends.cosyvoice.serve.modes import LlmPrompt, llm_prompt
from voicertc.backends.cosyvoice.serve.state import Cv2State, PendingVocode
from voicertc.backends.cosyvoice.serve.step_budget import UnitClock
from voicertc.backends.cosyvoice.serve.token2wav_v3 import vocode_batch_v3, vocode_batch_v3_parts
from voicertc.backends.cosyvoice.voice.text_v3 import DEFAULT_SYSTEM_PROMPT, ENDOFPROMPT
from voicertc.backends.cosyvoice.voice.voices import Voice
from voicertc.config import Config
from voicertc.engine.backend import StepResult, SynthStep
from voicertc.engine.schedule import ChunkSchedule
from voicertc.engine.utterance import Utterance
from voicertc.engine.work import Vocode, Work

logger = logging.getLogger(__name__)


def v3_prompt(voice: Voice, instruct: str, encode: Callable[[str], list[int]]) -> LlmPrompt:
    """`modes.llm_prompt` with CosyVoice3's mandatory `<|endofprompt|>` in the prompt text."""
    prompt = llm_prompt(voice, instruct, encode)
    if prompt.mode == "instruct":
        return prompt
    system = tuple(encode(DEFAULT_SYSTEM_PROMPT + ENDOFPROMPT))
    marker = system[-1]
    if prompt.text_ids and marker in prompt.text_ids:
        return prompt
    return LlmPrompt(prompt.mode, system + prompt.text_ids, prompt.speech_ids)


@dataclass
class Cv3State(Cv2State):
    """CosyVoice2's state; the vocoder unit's length is the new mel alone (v3's HiFT keeps per-conv tails,
    no mel cache)."""

    def plan(self, utt: Utterance[Cv2State]) -> Work | None:
        if not self.done and self.vocode_solve is not None:
            return self.vocode_solve.unit()
        if not self.done and self.flowed is not None:
            return Vocode(frames=self.flowed.mel.shape[2], final=self.flowed.plan.final)
        return super().plan(utt)


class CosyVoice3Backend(CosyVoice2Backend):
    """The `cosyvoice3` engine backend (threading rules as CosyVoice2's)."""

    name = "cosyvoice3"
    features = frozenset({"instruct"})  # speed (non-streaming re-timing) is CosyVoice2's only
    model: CosyVoice3Model
    state_class = Cv3State

    # the warm-up (CosyVoice2's: the captured stages, one LLM step, one flow + vocoder chunk) prefills
    # v3's prompt layout
    warm_up_prompt_ids = (ENDOFPROMPT_ID, 0, 1)

    def llm_prompt(self, voice: Voice, instruct: str) -> LlmPrompt:
        return v3_prompt(voice, instruct, self.model.text_frontend.encode)

    def _run_vocode(self, batch: Sequence[Cv2Job]) -> list[StepResult]:
        """The rows' incremental HiFT: rows in one stream phase as one forward (`vocode_batch_v3`),
        the others alone; a failed batch is retried row by row (its states are untouched). Under
        `[engine] max_step_ms` each phase group goes in parts across units (`PendingVocode`)."""
        work = batch[0].work
        assert isinstance(work, Vocode)
        if work.solve:
            return self._continue_vocode(batch)
        results: dict[int, StepResult] = {}
        groups: dict[Hashable, list[int]] = {}
        for i, job in enumerate(batch):
            try:
                st = self._state(job)
                if st.flowed is None or st.t2w is None:
                    raise RuntimeError("vocoder unit planned without a flowed chunk")
                key = st.t2w.hift_phase(st.flowed.plan, st.flowed.mel)  # type: ignore[attr-defined]
                groups.setdefault(key, []).append(i)
            except Exception as exc:  # noqa: BLE001 - isolated per utterance
                results[i] = exc
        clock = self.budget.start() if self.budget.budget_s > 0 else None
        for rows in groups.values():
            if clock is not None:
                self._start_parts(batch, rows, results, clock)
            else:
                self._vocode_group(batch, rows, results)
        return [results[i] for i in range(len(batch))]

    def _vocode_group(self, batch: Sequence[Cv2Job], rows: list[int], results: dict[int, StepResult]) -> None:
        """One phase group in one forward; if it fails, each row alone."""
        self.stats["vocode_batches"] += 1
        if len(rows) > 1:
            try:
                self._vocode_rows([batch[i] for i in rows], results, rows)
                return
            except Exception:  # noqa: BLE001 - retried alone below
                logger.warning("batched v3 vocoder step failed; retrying its %d rows alone", len(rows))
        for i in rows:
            try:
                self._vocode_rows([batch[i]], results, [i])
            except Exception as exc:  # noqa: BLE001 - isolated per utterance
                results[i] = exc

    def _start_parts(
        self, batch: Sequence[Cv2Job], rows: list[int], results: dict[int, StepResult], clock: UnitClock
    ) -> None:
        """One phase group's vocoder step in parts: its first parts now (at least one), the rest in the
        members' next units; a failure retries each row alone (whole: the states are untouched)."""
        jobs = [batch[i] for i in rows]
        states = [self._state(job) for job in jobs]
        t2ws = [st.t2w for st in states]
        flowed = [st.flowed for st in states]
        try:
            parts = vocode_batch_v3_parts(
                t2ws,  # type: ignore[arg-type]
                [f.plan for f in flowed],  # type: ignore[union-attr]
                [f.mel for f in flowed],  # type: ignore[union-attr]
                [f.flow_s for f in flowed],  # type: ignore[union-attr]
                to_host=self.lane.to_host_async,
            )
            work = jobs[0].work
            assert isinstance(work, Vocode)
            members = [(st, t2w, None) for st, t2w in zip(states, t2ws, strict=True)]
            saved = [hift_snapshot(t2w) for t2w in t2ws]  # type: ignore[arg-type]
            pending = PendingVocode(next(self._solves), parts, members, saved, work.frames, work.final)  # type: ignore[arg-type]
            chunks = self._advance_vocode(pending, clock)
        except Exception as exc:  # noqa: BLE001 - each row again alone (or the lone one fails)
            if len(rows) == 1:
                results[rows[0]] = exc
                return
            logger.warning("batched v3 vocoder step failed; retrying its %d rows alone", len(rows))
            self.stats["batch_fallbacks"] += 1
            for i in rows:
                try:
                    self._vocode_rows([batch[i]], results, [i])
                except Exception as row_exc:  # noqa: BLE001 - isolated per utterance
                    results[i] = row_exc
            return
        if chunks is None:
            for i, st in zip(rows, states, strict=True):
                st.vocode_solve = pending
                results[i] = SynthStep(sample_rate_hz=SAMPLE_RATE_HZ)
            return
        for i, job, st, chunk in zip(rows, jobs, states, chunks, strict=True):
            st.flowed = None
            results[i] = self._vocoded(job, chunk)

    def _vocode_rows(self, jobs: Sequence[Cv2Job], results: dict[int, StepResult], rows: list[int]) -> None:
        states = [self._state(job) for job in jobs]
        flowed = [st.flowed for st in states]
        t2ws = [st.t2w for st in states]
        if len(jobs) == 1:
            chunks = [t2ws[0].complete(flowed[0].plan, flowed[0].mel, flowed[0].flow_s)]  # type: ignore[union-attr]
        else:
            chunks = vocode_batch_v3(
                t2ws,  # type: ignore[arg-type]
                [f.plan for f in flowed],  # type: ignore[union-attr]
                [f.mel for f in flowed],  # type: ignore[union-attr]
                [f.flow_s for f in flowed],  # type: ignore[union-attr]
                to_host=self.lane.to_host_async,
            )
        for i, job, st, chunk in zip(rows, jobs, states, chunks, strict=True):
            st.flowed = None
            self._account(job.utt, chunk)
            results[i] = SynthStep(pcm=[chunk.pcm] if chunk.pcm.size else [], sample_rate_hz=SAMPLE_RATE_HZ)


def create_backend(config: Config) -> CosyVoice3Backend:
    """Load `config.engine.model_dir` (CosyVoice3) on the configured device as the engine backend."""
    engine = config.engine
    device = resolve_device(engine.device)
    dtype = torch_dtype(engine.dtype, device, half_on_cpu=False)  # v3 on CPU: float32 only
    model = load(engine.model_dir, device, dtype, check_frontend=True)
    if engine.dit_conv == "matmul":  # before the warm-up: its captured steps take this form
        convs = use_matmul_convs(model.flow.decoder.estimator)
        logger.info("engine.dit_conv = matmul: %d DiT position convs as batched matmuls", convs)
    s = config.schedule
    schedule = ChunkSchedule(
        first_hop_tokens=s.first_hop_tokens,
        growth=s.growth,
        max_hop_tokens=s.max_hop_tokens,
        lookahead_tokens=s.lookahead_tokens,
        grid_tokens=s.grid_tokens or None,
        final_chunk=s.final_chunk,  # type: ignore[arg-type]
    )
    # the same keys as CosyVoice2's (it once took only two: `cuda_graphs` and `text_workers` did nothing)
    backend = CosyVoice3Backend(model, schedule, engine.voices_dir or None, backend_options(config))
    backend.warm_up()
    return backend
