"""Text-in streaming for the CosyVoice2 and CosyVoice3 LLMs (official `inference_bistream`, cosyvoice.md
§3.4).

Runs on the engine thread. The LLM was trained on interleaved groups (`prepare_lm_input_target`):
[sos, instruct, 5 text, 15 speech, 5 text, 15 speech, ..., remaining text, task_id, remaining speech,
eos], with `fill` predicted after each 15-speech group. At inference the prompt transcript and prompt
speech fill the first groups, then every 5 new text tokens let the model speak 15 more tokens; when the
text stream ends, the rest of the text and task_id are fed and the model speaks until a stop id.

One mixing rule for both versions; what differs is read from `bistream_ids(llm)`:
* CosyVoice2: ids of `Qwen2LM` (fill 6563, eos 6561); the whole prompt text is mixed text;
* CosyVoice3: ids of `CosyVoice3LM` (fill 6564, eos 6562, 200 stop ids) and v3's prompt layout: the
  prompt text up to and including its first `<|endofprompt|>` (the system prompt or the instruction,
  the training layout's `instruct` part) is fed whole right after sos; only the rest of the prompt text
  (the transcript) is mixed with the prompt speech in 5:15 groups, as the official v3 loop does.

`plan_next_input` is the pure bookkeeping (which segments to feed next, or wait); `BistreamSession`
owns the KV cache and calls it. Deviations from the official loop, all toward the training layout:
* text is taken 5 tokens per fill however it was chunked on arrival;
* the official loop re-feeds the last speech token after a fill when the text ends (a stale input) and
  drops unused prompt speech at the end: here neither happens;
* with a positive multiple of 15 prompt speech tokens the official loop speaks a group before asking
  for text; here it asks first (`first_fill_index`);
* CosyVoice3 without prompt speech (cross-lingual, instruct, sft): the official loop starts decoding
  right after [sos, instruct] with no text at all (its "nothing fed yet" test looks for an input of
  length 1); here, as in v2 and in training, 5 text tokens come first;
* before the text ends the official loop masks id 6561 only (v2 eos, v3 sos) and raises on any other id
  >= 6561 but fill; v2 keeps that mask (a sampled 6562 ends the utterance instead), v3 masks every stop
  id but fill (its targets there are speech or fill only);
* the final phase is capped at 20 tokens per text token; v3 ends quietly on any of its stop ids there,
  as its unistream loop does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from voicertc.backends.cosyvoice.llm import qwen2lm as v2
from voicertc.backends.cosyvoice.llm import v3
from voicertc.backends.cosyvoice.llm.qwen2lm import MAX_TOKEN_TEXT_RATIO, SOS_ROW, TASK_ID_ROW, Qwen2LM
from voicertc.backends.cosyvoice.llm.sampling import SamplingMode, sample_token

if TYPE_CHECKING:
    from voicertc.backends.cosyvoice.llm.kv import KVSlot

logger = logging.getLogger(__name__)

SegmentKind = Literal["sos", "text", "task_id", "speech"]


@dataclass(frozen=True)
class BistreamIds:
    """The special ids one LLM version's bistream loop reads (cosyvoice.md §3.1)."""

    eos: int
    fill: int
    stop: frozenset[int]  # a sampled id in here (but a fill before the text ends) ends the utterance
    ban_before_final: tuple[int, ...]  # masked while text may still arrive
    quiet_final_stops: frozenset[int]  # stop ids that end the final phase without a warning
    instruct_end: int | None  # v3: the prompt text up to this id is fed whole after sos; v2: None


V2_IDS = BistreamIds(
    eos=v2.EOS_ID,
    fill=v2.FILL_ID,
    stop=v2.STOP_IDS,
    ban_before_final=(v2.EOS_ID,),
    quiet_final_stops=frozenset({v2.EOS_ID}),
    instruct_end=None,
)
V3_IDS = BistreamIds(
    eos=v3.EOS_ID,
    fill=v3.FILL_ID,
    stop=v3.STOP_IDS,
    ban_before_final=tuple(sorted(v3.STOP_IDS - {v3.FILL_ID})),
    quiet_final_stops=v3.STOP_IDS,
    instruct_end=v3.ENDOFPROMPT_ID,
)


def bistream_ids(llm: Qwen2LM) -> BistreamIds:
    """CosyVoice3's ids for a `CosyVoice3LM`, CosyVoice2's otherwise."""
    return V3_IDS if isinstance(llm, v3.CosyVoice3LM) else V2_IDS


def split_instruct(llm: Qwen2LM, prompt_text_tokens: Sequence[int]) -> tuple[list[int], list[int]]:
    """(instruct, mixed text) of a prompt text: v3 cuts after its first `<|endofprompt|>` (ValueError
    if there is none, as the reference asserts); v2 mixes all of it."""
    ids = llm.check_text_ids(prompt_text_tokens)
    end = bistream_ids(llm).instruct_end
    if end is None:
        return [], ids
    if end not in ids:
        raise ValueError(
            f"CosyVoice3 bistream needs <|endofprompt|> (id {end}) in the prompt text "
            "(e.g. 'You are a helpful assistant.<|endofprompt|>' before the transcript)"
        )
    cut = ids.index(end) + 1
    return ids[:cut], ids[cut:]


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


def first_fill_index(n_prompt_speech: int, n_speech: int = 15) -> int:
    """How many tokens the model speaks before its first fill: the rest of the last prompt-speech group,
    or a whole group without prompt speech. The official `(P // 15 + 1) * 15 - P` is a group late when
    P is a positive multiple of 15 (training puts fill right after a full group): here a fill is due at
    once then, so the next 5 text tokens come first."""
    return -n_prompt_speech % n_speech if n_prompt_speech else n_speech


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
    ids: BistreamIds = V2_IDS
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
        """A session on a fresh `DynamicCache`, or on `kv` (a `SlotKV` row, emptied) for batched decode.

        CosyVoice3: `prompt_text_tokens` must hold `<|endofprompt|>`; everything up to it is fed first."""
        instruct, mixed = split_instruct(llm, prompt_text_tokens)
        prompt_speech = llm.check_speech_ids(prompt_speech_tokens)
        if kv is not None:
            kv.length = 0
        n_speech = llm.config.mix_ratio[1]
        n_prompt = len(prompt_speech)
        head = [Segment("sos"), *([Segment("text", tuple(instruct))] if instruct else [])]
        return cls(
            llm=llm,
            prompt_speech_left=prompt_speech,
            text_queue=mixed,
            ids=bistream_ids(llm),
            pending=head,
            sampling=sampling,
            generator=generator,
            next_fill_index=first_fill_index(n_prompt, n_speech),
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
        ids = self.ids
        if token == ids.fill and not self.final:
            self.next_fill_index = len(self.out_tokens) + self.llm.config.mix_ratio[1] + 1
            self.out_tokens.append(token)
            self.awaiting_text = True
            return None
        if token in ids.stop:
            if not (self.final and token in ids.quiet_final_stops):
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
            return self.ids.fill
        if force is not None:
            return int(force)
        return sample_token(
            self.logits,
            self.out_tokens,
            mode=self.sampling,
            params=self.llm.sampling_params,
            ban_ids=() if self.final else self.ids.ban_before_final,
            generator=self.generator,
        )
