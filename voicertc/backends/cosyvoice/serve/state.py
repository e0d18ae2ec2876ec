"""One utterance's CosyVoice2 synthesis state and the pure plan of its next unit of work.

Runs on the engine thread. Text policy:
* **whole text** — the utterance's input had ended when synthesis started (`say`, a whole speak
  request): the official frontend normalises and splits it (`split_paragraph`), and every piece is its
  own LLM call (unistream, prefilled from the voice's cached [sos, prompt text] prefix) with its own
  token2wav stream, as the reference does;
* **deltas** — text is still arriving (an agent's LLM output): `SentenceStream(words=True)` hands on
  whole sentences and, inside a sentence, the words completed so far; each piece is normalised,
  tokenised and pushed into one bistream LLM session (5 text : 15 speech interleaving), whose speech
  tokens feed one token2wav stream; so speech starts once 5 text tokens are in, mid-sentence, before
  the text stream ends.

`plan` reads the state and the utterance's text and names the next unit (`voicertc.engine.work`); it
changes nothing. Text is taken from the utterance only by the `Frontend` unit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.flow.flow import FlowStreamState, StreamSolve
from voicertc.backends.cosyvoice.hift.stream import HiftStreamState
from voicertc.backends.cosyvoice.llm.bistream import BistreamSession
from voicertc.backends.cosyvoice.llm.kv import KVSlot
from voicertc.backends.cosyvoice.llm.qwen2lm import LlmSession
from voicertc.backends.cosyvoice.llm.streamer import StreamedSession
from voicertc.backends.cosyvoice.serve.modes import LlmPrompt
from voicertc.backends.cosyvoice.serve.token2wav import Chunk, ChunkPlan, Token2WavStream
from voicertc.backends.cosyvoice.voice.text import SentenceStream
from voicertc.backends.cosyvoice.voice.text_prep import PreparedText
from voicertc.backends.cosyvoice.voice.voices import Voice
from voicertc.engine.utterance import Utterance
from voicertc.engine.work import Decode, Finish, FlowChunk, Frontend, Prefill, Vocode, VoicePrompt, Work

TextMode = Literal["whole", "deltas"]


@dataclass
class FlowedChunk:
    """A chunk the flow has computed, waiting for the vocoder: in one engine step, or (a speed window's
    re-timed mel, up to `speed_window_tokens / speed` tokens' worth) in pieces of `piece_frames`."""

    plan: ChunkPlan
    mel: Tensor  # [1, 80, F]
    flow_s: float
    piece_frames: int | None = None  # None: vocoded whole

    @property
    def last_piece(self) -> bool:
        return self.piece_frames is None or self.mel.shape[2] <= self.piece_frames

    @property
    def next_frames(self) -> int:
        """Mel frames the next vocoder step takes."""
        return self.mel.shape[2] if self.last_piece else int(self.piece_frames or 0)

    def next_piece(self, emitted_tokens: int) -> tuple[ChunkPlan, Tensor, FlowedChunk | None]:
        """The next vocoder step's plan and mel, and what is left after it (None: nothing). A piece
        before the last completes no tokens (`end_tokens` stays at `emitted_tokens`) and is not final."""
        if self.last_piece:
            return self.plan, self.mel, None
        frames = self.next_frames
        head = ChunkPlan(self.plan.new_tokens[:, :0], emitted_tokens, 0, final=False)
        return head, self.mel[:, :, :frames], replace(self, mel=self.mel[:, :, frames:], flow_s=0.0)


@dataclass(eq=False)
class PendingFlow:
    """A flow chunk batched across `members` between its Euler steps (engine thread). Each member's next
    unit continues it (`FlowChunk(solve=number)`: they batch with each other only), whichever of them
    the scheduler runs; its last step hands every member still holding its stream the mel. A member
    released meanwhile keeps its row in the batch (computed, then dropped)."""

    number: int
    stream: StreamSolve
    members: list[tuple[Cv2State, Token2WavStream, ChunkPlan]]
    saved: list[FlowStreamState]  # the members' flow states before the chunk (a failed step retries them)
    flow_s: float = 0.0  # wall time of the units so far, for the whole batch

    def unit(self) -> FlowChunk:
        plan = self.members[0][2]
        return FlowChunk(plan.advance_tokens, plan.final, solve=self.number)


@dataclass(frozen=True)
class HiftSnapshot:
    """A stream's vocoder state before a step: HiFT caches and its excitation generator's state."""

    state: HiftStreamState | None
    rng: Tensor | None


@dataclass(eq=False)
class PendingVocode:
    """A vocoder step batched across `members` between its parts (engine thread), as `PendingFlow`: each
    member's next unit continues it (`Vocode(solve=number)`); the last part returns every row's chunk.
    A member released meanwhile keeps its row (computed, then dropped)."""

    number: int
    parts: Generator[None, None, list[Chunk]]
    members: list[tuple[Cv2State, Token2WavStream, FlowedChunk | None]]  # (state, stream, mel left after)
    saved: list[HiftSnapshot]  # the members' vocoder states before the step (a failure retries them)
    frames: int
    final: bool
    chunks: list[Chunk] | None = None  # once its last part ran: a chunk per member, in order

    def unit(self) -> Vocode:
        return Vocode(frames=self.frames, final=self.final, solve=self.number)


@dataclass
class PendingText:
    """Raw text waiting to be prepared (normalised + tokenised) off the engine thread, in order. At most
    one job is in flight per utterance, so utterances sharing the preparation pool take turns."""

    waiting: deque[tuple[str, bool]] = field(default_factory=deque)  # (text, split) not yet submitted
    inflight: Future[PreparedText] | None = None

    @property
    def busy(self) -> bool:
        """Text is still being prepared: the utterance must not end (or end its LLM's text) yet."""
        return bool(self.waiting) or self.inflight is not None

    def ready(self) -> bool:
        """A `Frontend` unit has work: a finished job's result to install, or the next job to submit."""
        if self.inflight is None:
            return bool(self.waiting)
        return self.inflight.done()

    def take(self) -> PreparedText:
        """The finished job's result (raises what the job raised)."""
        assert self.inflight is not None and self.inflight.done()
        future, self.inflight = self.inflight, None
        return future.result()

    def cancel(self) -> None:
        self.waiting.clear()
        if self.inflight is not None:
            self.inflight.cancel()  # a job already running finishes in its process (one chunk at most)
        self.inflight = None


@dataclass
class Cv2State:
    """Everything one utterance holds (KV slot, flow/HiFT caches, text); freed by `release()`.

    Invariants: at most one LLM session (`llm` for whole text, `bistream` for deltas) and one `t2w`
    stream at a time; `flow_solve` is set between the units of a flow chunk, `flowed` between its last
    `FlowChunk` unit and its `Vocode`.
    """

    voice: Voice
    prompt: LlmPrompt  # the LLM prompt parts of this utterance's mode (modes.py)
    llm_generator: torch.Generator
    hift_generator: torch.Generator
    speed: float = 1.0  # != 1: every segment is synthesized without streaming, then re-timed
    mode: TextMode | None = None
    segments: deque[list[int]] | None = None  # whole text: token ids of the pieces not yet spoken
    segment_texts: deque[str] | None = None  # whole text: each segment's (normalised) text, for heard_text
    splitter: SentenceStream = field(default_factory=lambda: SentenceStream(words=True))
    text_ended: bool = False  # deltas: the bistream session has been told
    llm: LlmSession | StreamedSession | None = None  # StreamedSession: `[engine] llm` decodes elsewhere
    llm_seed: int = 0  # a streamed segment's sampling seed (llm_seed + segment number)
    prefill_parts: Generator[None, None, Tensor] | None = (
        None  # `llm`'s prompt fed a layer per part, unfinished
    )
    segments_started: int = 0
    bistream: BistreamSession | None = None
    t2w: Token2WavStream | None = None
    flowed: FlowedChunk | None = None
    flow_solve: PendingFlow | None = None  # set while a flow chunk of this utterance is between Euler steps
    vocode_solve: PendingVocode | None = None  # set while a vocoder step of this utterance is between parts
    window_flow_s: float = 0.0  # flow time of a full-attention call solved so far (its earlier units)
    done: bool = False
    started_s: float | None = None  # worker clock at the first unit
    llm_steps: int = 0  # LLM forwards of the current segment
    first_hop_at_s: float | None = None  # perf_counter when the first prefill finished
    first_hop_recorded: bool = False
    pending: PendingText = field(default_factory=PendingText)  # text in preparation (text_prep.py)

    def release(self) -> None:
        """Drop every cache (KV slot, flow and HiFT state, the mel waiting for the vocoder)."""
        self.end_llm()
        self.pending.cancel()
        if self.t2w is not None:
            self.t2w.release()
        self.t2w = None
        self.flowed = None
        self.flow_solve = None
        self.vocode_solve = None
        self.segments = None
        self.done = True

    def end_llm(self) -> None:
        """Give the LLM session's KV slot back (the session is over)."""
        self.prefill_parts = None
        for session in (self.llm, self.bistream):
            if isinstance(session, StreamedSession):
                session.close()
            elif session is not None and isinstance(session.cache, KVSlot):
                session.cache.release()
        self.llm = None
        self.bistream = None

    # ---- text intake (the Frontend unit; cheap, no model work) ---------------------------------

    def take_text(self, utt: Utterance[Cv2State]) -> list[str]:
        """Fix the text mode at the first text; delta text goes through the sentence splitter.

        Returns the complete sentences (deltas) or the whole text (one item) now ready for the frontend.
        """
        if self.mode is None:
            self.mode = "whole" if utt.input_ended else "deltas"
        if self.mode == "whole":
            return [utt.take_text()]
        sentences = self.splitter.push(utt.take_text()) if utt.text else []
        if utt.input_ended and not self.text_ended:
            sentences.extend(self.splitter.flush())
        return sentences

    # ---- what next (pure) ---------------------------------------------------------------------

    def plan(self, utt: Utterance[Cv2State]) -> Work | None:
        """The unit that makes progress now, or None when only new text (or a streamed token) can help.
        An utterance whose voice's prompt caches are not built yet builds them first (a stored voice's
        first use), whether or not its text has come: an agent's first delta finds the voice ready."""
        if not self.done and not self.voice.caches.ready:
            return VoicePrompt()
        return self._plan(utt)

    def _plan(self, utt: Utterance[Cv2State]) -> Work | None:
        if self.done:
            return None
        if self.vocode_solve is not None:
            return self.vocode_solve.unit()
        if self.flowed is not None:
            hift = self.t2w.hift_state if self.t2w is not None else None
            frames = self.flowed.next_frames
            if hift is not None and hift.mel_cache is not None:
                frames += hift.mel_cache.shape[2]
            return Vocode(frames=frames, final=self.flowed.plan.final and self.flowed.last_piece)
        if self.flow_solve is not None:
            return self.flow_solve.unit()
        if self.mode is None:
            return Frontend() if utt.input_ended or utt.text.strip() else None
        if self.pending.ready():
            return Frontend()  # install what the preparation pool sent back
        ending = utt.input_ended and not self.text_ended and not self.pending.busy
        if self.mode == "deltas" and (self.bistream is None or utt.text or ending):
            return Frontend()
        t2w = self.t2w
        if t2w is not None and t2w.ready():
            nxt = t2w.next_chunk()
            assert nxt is not None
            return FlowChunk(nxt[1])
        if self.mode == "whole":
            return self._whole_plan()
        return self._deltas_plan()

    def _decode(self) -> Decode:
        nxt = self.t2w.next_chunk() if self.t2w is not None else None
        return Decode(*nxt) if nxt is not None else Decode()

    def _final_or_next(self, has_next: bool) -> Work | None:
        """The segment's LLM is over: its final chunk, then the next segment (or the end)."""
        if self.t2w is not None and (advance := self.t2w.final_advance()) is not None:
            return FlowChunk(advance, final=True)
        return Prefill() if has_next else self._finish_or_wait()

    def _finish_or_wait(self) -> Work | None:
        """Nothing left to speak: the end, unless text is still being prepared (its result wakes us)."""
        return None if self.pending.busy else Finish()

    def _whole_plan(self) -> Work | None:
        if self.segments is None:
            return Frontend()
        if self.llm is not None and not self.llm.finished:
            if isinstance(self.llm, StreamedSession) and not self.llm.ready():
                return None  # the streamer's next token wakes the worker
            return self._decode()
        if self.llm is None and self.t2w is None:
            return Prefill() if self.segments else self._finish_or_wait()
        return self._final_or_next(bool(self.segments))

    def _deltas_plan(self) -> Work | None:
        assert self.bistream is not None
        if not self.bistream.finished:
            return None if self.bistream.needs_text else self._decode()
        return self._final_or_next(False)
