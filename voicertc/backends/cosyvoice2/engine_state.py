"""One utterance's CosyVoice2 synthesis state and the pure choice of what to do with it next.

Runs on the engine thread. Text policy:
* **whole text** — the utterance's input had ended when synthesis started (`say`, a whole speak
  request): the official frontend normalises and splits it (`split_paragraph`), and every piece is its
  own LLM call (unistream, prefilled from the voice's cached [sos, prompt text] prefix) with its own
  token2wav stream, as the reference does;
* **deltas** — text is still arriving (an agent's LLM output): `SentenceStream` cuts it into
  sentences, each sentence is normalised, tokenised and pushed into one bistream LLM session (5 text :
  15 speech interleaving), whose speech tokens feed one token2wav stream; so speech starts after the
  first sentence, before the text stream ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import torch

from voicertc.backends.cosyvoice2.bistream import BistreamSession
from voicertc.backends.cosyvoice2.llm import LlmSession
from voicertc.backends.cosyvoice2.text import SentenceStream
from voicertc.backends.cosyvoice2.token2wav import Chunk, Token2WavStream
from voicertc.backends.cosyvoice2.voices import Voice
from voicertc.engine.utterance import Utterance

TextMode = Literal["whole", "deltas"]
Action = Literal["raise", "emit", "chunk", "frontend", "decode", "finish", "start", "done"]


@dataclass
class Cv2State:
    """Everything one utterance holds (KV cache, flow/HiFT caches, text); freed by `release()`.

    Invariants: at most one LLM session (`llm` for whole text, `bistream` for deltas) and one
    `t2w` stream at a time; `ready_chunks` holds chunks computed in a batch led by another utterance,
    not yet handed to the worker; `error` is a failure found while this utterance was a batch partner.
    """

    voice: Voice
    llm_generator: torch.Generator
    hift_generator: torch.Generator
    mode: TextMode | None = None
    segments: deque[list[int]] | None = None  # whole text: token ids of the pieces not yet spoken
    splitter: SentenceStream = field(default_factory=SentenceStream)
    sentences: deque[str] = field(default_factory=deque)  # deltas: complete sentences not yet fed
    text_ended: bool = False  # deltas: the bistream session has been told
    llm: LlmSession | None = None
    bistream: BistreamSession | None = None
    t2w: Token2WavStream | None = None
    ready_chunks: deque[Chunk] = field(default_factory=deque)
    error: BaseException | None = None
    done: bool = False
    started_s: float | None = None  # worker clock at the first step
    llm_steps: int = 0  # LLM forwards of the current segment
    first_hop_at_s: float | None = None  # perf_counter when the first prefill finished
    first_hop_recorded: bool = False

    def release(self) -> None:
        """Drop every cache (KV cache, flow and HiFT state, queued chunks)."""
        if self.t2w is not None:
            self.t2w.release()
        self.t2w = None
        self.llm = None
        self.bistream = None
        self.ready_chunks.clear()
        self.segments = None
        self.sentences.clear()
        self.done = True

    # ---- text intake (cheap, no model work) ---------------------------------------------------

    def intake(self, utt: Utterance) -> None:
        """Fix the text mode at the first text, and move delta text into the sentence splitter."""
        if self.mode is None:
            if utt.input_ended:
                self.mode = "whole"
            elif utt.text.strip():
                self.mode = "deltas"
        if self.mode == "deltas":
            if utt.text:
                self.sentences.extend(self.splitter.push(utt.take_text()))
            if utt.input_ended and not self.text_ended:
                self.sentences.extend(self.splitter.flush())

    # ---- what next ----------------------------------------------------------------------------

    def next_action(self, utt: Utterance) -> Action | None:
        """The step that makes progress now, or None when only new text can help."""
        if self.error is not None:
            return "raise"
        if self.ready_chunks:
            return "emit"
        if self.done:
            return None
        self.intake(utt)
        if self.t2w is not None and self.t2w.ready():
            return "chunk"
        if self.mode == "whole":
            return self._whole_action()
        if self.mode == "deltas":
            return self._deltas_action(utt)
        return None

    def _whole_action(self) -> Action:
        if self.segments is None:
            return "frontend"
        if self.llm is not None:
            return "finish" if self.llm.finished else "decode"
        return "start" if self.segments else "done"

    def _deltas_action(self, utt: Utterance) -> Action | None:
        if self.bistream is None or self.sentences or (utt.input_ended and not self.text_ended):
            return "frontend"
        if not self.bistream.finished:
            return None if self.bistream.needs_text else "decode"
        return "finish" if self.t2w is not None else "done"
