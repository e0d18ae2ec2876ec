"""Text-in streaming for the CosyVoice2 LLM (official `inference_bistream`, cosyvoice.md §3.4).

Runs on the engine thread. The LLM was trained on interleaved groups: [sos, 5 text, 15 speech, 5 text,
15 speech, ..., remaining text, task_id, remaining speech, eos], with `fill` (6563) predicted after
each 15-speech group. At inference the prompt transcript and prompt speech fill the first groups, then
every 5 new text tokens let the model speak 15 more tokens; when the text stream ends, the rest of the
text and task_id are fed and the model speaks until eos.

`plan_next_input` is the pure bookkeeping (which segments to feed next, or wait); `BistreamSession`
owns the KV cache and calls it. Deviations from the official loop, all toward the training layout:
text is taken 5 tokens per fill however it was chunked on arrival; the official loop re-feeds the
last speech token after a fill when the text ends (a stale input), and drops unused prompt speech at
the end: here neither happens. A `fill` or id 6562 sampled where the official loop would raise
ValueError ends the utterance instead, and the final phase is capped at 20 tokens per text token.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from voicertc.backends.cosyvoice.llm.qwen2lm import (
    EOS_ID,
    FILL_ID,
    MAX_TOKEN_TEXT_RATIO,
    SOS_ROW,
    STOP_IDS,
    TASK_ID_ROW,
    Qwen2LM,
)
from voicertc.backends.cosyvoice.llm.sampling import SamplingMode, sample_token

if TYPE_CHECKING:
    from voicertc.backends.cosyvoice.llm.kv import KVSlot

logger = logging.getLogger(__name__)

SegmentKind = Literal["sos", "text", "task_id", "speech"]


@dataclass(frozen=True)
class Segment:
    """A run of LLM inputs of one kind (sos / task_id carry no tokens)."""

    kind: SegmentKind
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class InputPlan:
    """What to feed next and what it uses up; `final` = the text has ended, decode until eos."""

    segments: tuple[Segment, ...]
    text_used: int
    prompt_speech_used: int
    final: bool = False


def plan_next_input(
    text_queue: Sequence[int],
    prompt_speech_left: Sequence[int],
    *,
    awaiting_text: bool,
    text_ended: bool,
    mix_ratio: tuple[int, int] = (5, 15),
) -> InputPlan | None:
    """The next inputs of the official bistream loop, or None when it must wait for more text.

    Prompt speech is interleaved in [5 text, 15 speech] groups while it lasts; then, when the model
    asked for text (a fill, or nothing fed beyond sos), 5 text tokens; at the end of the text, all
    remaining text, task_id and any unused prompt speech.
    """
    n_text, n_speech = mix_ratio
    segments: list[Segment] = []
    text_used = speech_used = 0
    while speech_used < len(prompt_speech_left) and len(text_queue) - text_used >= n_text:
        segments.append(Segment("text", tuple(text_queue[text_used : text_used + n_text])))
        segments.append(Segment("speech", tuple(prompt_speech_left[speech_used : speech_used + n_speech])))
        text_used += n_text
        speech_used += n_speech
    prompt_done = speech_used >= len(prompt_speech_left)
    if prompt_done and not segments and awaiting_text and len(text_queue) - text_used >= n_text:
        segments.append(Segment("text", tuple(text_queue[text_used : text_used + n_text])))
        text_used += n_text
    needs_more = not prompt_done or (awaiting_text and not segments)
    if needs_more and text_ended:
        segments.append(Segment("text", tuple(text_queue[text_used:])))
        segments.append(Segment("task_id"))
        segments.append(Segment("speech", tuple(prompt_speech_left[speech_used:])))
        kept = tuple(s for s in segments if s.tokens or s.kind == "task_id")
        return InputPlan(kept, len(text_queue), len(prompt_speech_left), final=True)
    if needs_more:
        return None
    return InputPlan(tuple(segments), text_used, speech_used)


def embed_segments(llm: Qwen2LM, segments: Sequence[Segment]) -> Tensor:
    """The LLM input embeddings [1, T, H] of `segments`."""
    parts = []
    for seg in segments:
        if seg.kind == "sos":
            parts.append(llm.special_embedding(SOS_ROW))
        elif seg.kind == "task_id":
            parts.append(llm.special_embedding(TASK_ID_ROW))
        elif seg.kind == "text":
            parts.append(llm.embed_text(seg.tokens))
        else:
            parts.append(llm.embed_speech(seg.tokens))
    return torch.cat(parts, dim=1)


@dataclass
class BistreamSession:
    """One utterance whose text arrives in pieces. Owned by the engine thread.

    Call `push_text` as text token ids arrive and `end_text` once; call `step` while neither
    `needs_text` nor `finished`: each call runs at most one forward and returns a speech token, or
    None (a fill step, or the end). `fed` logs every input segment, in order.
    """

    llm: Qwen2LM
    prompt_speech_left: list[int]
    text_queue: list[int]
    sampling: SamplingMode = "ras"
    generator: torch.Generator | None = None
    cache: DynamicCache | KVSlot = field(default_factory=DynamicCache)
    pending: list[Segment] = field(default_factory=lambda: [Segment("sos")])
    out_tokens: list[int] = field(default_factory=list)  # includes fills, as the official loop counts
    next_fill_index: int = 0
    awaiting_text: bool = True
    text_ended: bool = False
    final: bool = False
    finished: bool = False
    new_text_tokens: int = 0
    final_tokens: int = 0
    logits: Tensor | None = None
    fed: list[Segment] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        llm: Qwen2LM,
        prompt_text_tokens: Sequence[int] = (),
        prompt_speech_tokens: Sequence[int] = (),
        *,
        sampling: SamplingMode = "ras",
        generator: torch.Generator | None = None,
        kv: KVSlot | None = None,
    ) -> BistreamSession:
        """A session on a fresh `DynamicCache`, or on `kv` (a `SlotKV` row, emptied) for batched decode."""
        if kv is not None:
            kv.length = 0
        n_speech = llm.config.mix_ratio[1]
        n_prompt = len(prompt_speech_tokens)
        return cls(
            llm=llm,
            prompt_speech_left=llm.check_speech_ids(prompt_speech_tokens),
            text_queue=llm.check_text_ids(prompt_text_tokens),
            sampling=sampling,
            generator=generator,
            next_fill_index=(n_prompt // n_speech + 1) * n_speech - n_prompt,
            **({"cache": kv} if kv is not None else {}),  # type: ignore[arg-type]
        )

    def push_text(self, text_tokens: Sequence[int]) -> None:
        if self.text_ended:
            raise ValueError("push_text after end_text")
        ids = self.llm.check_text_ids(text_tokens)
        self.text_queue.extend(ids)
        self.new_text_tokens += len(ids)

    def end_text(self) -> None:
        self.text_ended = True

    @property
    def needs_text(self) -> bool:
        """Nothing can happen until more text arrives (or the text ends)."""
        return not self.finished and self.awaiting_text and self._plan() is None

    def _plan(self) -> InputPlan | None:
        return plan_next_input(
            self.text_queue,
            self.prompt_speech_left,
            awaiting_text=True,
            text_ended=self.text_ended,
            mix_ratio=self.llm.config.mix_ratio,
        )

    def _take(self, plan: InputPlan) -> None:
        self.pending.extend(plan.segments)
        del self.text_queue[: plan.text_used]
        del self.prompt_speech_left[: plan.prompt_speech_used]
        self.awaiting_text = False
        self.final = plan.final

    @torch.inference_mode()
    def step(self, *, force: int | None = None) -> int | None:
        """One forward + one token; None for a fill step, while waiting for text, or at the end.

        `force` replaces a sampled id (tests); a fill due at `next_fill_index` takes precedence.
        """
        embeds = self.prepare()
        if embeds is None:
            return None
        self.logits = self.llm.feed(self.cache, embeds)
        return self.accept(force=force)

    def prepare(self) -> Tensor | None:
        """The input embeddings [1, T, H] of the next forward (taking text if awaited), or None (none now)."""
        if self.finished:
            return None
        if self.awaiting_text:
            plan = self._plan()
            if plan is None:
                return None
            self._take(plan)
        embeds = embed_segments(self.llm, self.pending)
        self.fed.extend(self.pending)
        self.pending = []
        return embeds

    def accept(self, *, force: int | None = None) -> int | None:
        """The token for `self.logits` (just computed for `prepare()`'s input); see `step`."""
        token = self._choose(force)
        if token == FILL_ID and not self.final:
            self.next_fill_index = len(self.out_tokens) + self.llm.config.mix_ratio[1] + 1
            self.out_tokens.append(token)
            self.awaiting_text = True
            return None
        if token in STOP_IDS:
            if not (self.final and token == EOS_ID):
                logger.warning("bistream: unexpected stop id %d, ending the utterance", token)
            self.finished = True
            return None
        self.out_tokens.append(token)
        self.pending = [Segment("speech", (token,))]
        if self.final:
            self.final_tokens += 1
            self.finished = self.final_tokens >= MAX_TOKEN_TEXT_RATIO * max(self.new_text_tokens, 1)
        return token

    def _choose(self, force: int | None) -> int:
        assert self.logits is not None
        if not self.final and len(self.out_tokens) == self.next_fill_index:
            return FILL_ID
        if force is not None:
            return int(force)
        return sample_token(
            self.logits,
            self.out_tokens,
            mode=self.sampling,
            params=self.llm.sampling_params,
            ban_ids=() if self.final else (EOS_ID,),
            generator=self.generator,
        )
