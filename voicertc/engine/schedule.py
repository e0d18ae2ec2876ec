"""ChunkSchedule: when the flow may run, as a pure function of the chunk index.

Shared and immutable: every utterance starts at its own first hop (the reference stores the growing
hop on the shared model and never resets it, so later requests start at the largest hop).

Chunk ends lie on a grid counted from the prompt start (the flow's chunk masks are anchored there).
The reference's grid is the first hop itself: it pads the first chunk by up to 24 tokens so that
its end lands there. With `grid_tokens` set (the flow's 25-token chunk), `first_hop_tokens` is the
least number of new tokens of the first chunk instead, whose end is the next grid point: e.g. 13
(at least 0.52 s of audio) starts speech after 13..37 tokens instead of the reference's 25..49.
The mel is the same either way (chunk ends on the grid, same masks); only the split differs.

`final_chunk` says how the last chunk of an utterance is computed: "chunk_mask" (ours: the chunk
masks stay, O(1) per chunk and consistent with the streamed chunks) or "reference" (the official loop:
the whole utterance again with full attention, whose frames after the emitted ones are the last chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinalChunk = Literal["chunk_mask", "reference"]
FINAL_CHUNK_MODES: tuple[FinalChunk, ...] = ("chunk_mask", "reference")


@dataclass(frozen=True)
class ChunkSchedule:
    first_hop_tokens: int = 25
    growth: int = 2
    max_hop_tokens: int = 100
    lookahead_tokens: int = 3
    grid_tokens: int | None = None  # None: the first hop is the grid (the reference)
    final_chunk: FinalChunk = "chunk_mask"

    def __post_init__(self) -> None:
        if self.first_hop_tokens < 1:
            raise ValueError("first_hop_tokens must be >= 1")
        if self.growth < 1:
            raise ValueError("growth must be >= 1")
        if self.max_hop_tokens < self.first_hop_tokens:
            raise ValueError("max_hop_tokens must be >= first_hop_tokens")
        if self.lookahead_tokens < 0:
            raise ValueError("lookahead_tokens must be >= 0")
        if self.grid_tokens is not None and self.grid_tokens < 1:
            raise ValueError("grid_tokens must be >= 1 (or None)")
        if self.final_chunk not in FINAL_CHUNK_MODES:
            raise ValueError(f"final_chunk must be one of {', '.join(FINAL_CHUNK_MODES)}")

    @property
    def grid(self) -> int:
        """Chunk ends are multiples of this many tokens counted from the prompt start."""
        return self.first_hop_tokens if self.grid_tokens is None else self.grid_tokens

    def hop_tokens(self, chunk_index: int) -> int:
        """Tokens emitted by chunk `chunk_index` (chunk 0: before the prompt padding). Later hops
        grow from the first hop rounded up to the grid, so they keep chunk ends on it."""
        if chunk_index == 0:
            return self.first_hop_tokens
        base = -(-self.first_hop_tokens // self.grid) * self.grid
        return min(self.max_hop_tokens, base * self.growth**chunk_index)

    def prompt_pad_tokens(self, prompt_tokens: int) -> int:
        """Extra tokens in the first chunk so that its end lands on the grid (0 .. grid-1)."""
        return -(prompt_tokens + self.first_hop_tokens) % self.grid

    def chunk_end_tokens(self, chunk_index: int, prompt_tokens: int) -> int:
        """Generated tokens that chunks 0..chunk_index emit together (excluding lookahead)."""
        emitted = self.prompt_pad_tokens(prompt_tokens)
        for i in range(chunk_index + 1):
            emitted += self.hop_tokens(i)
        return emitted

    def ready(self, chunk_index: int, prompt_tokens: int, available_tokens: int) -> bool:
        """Chunk `chunk_index` can run once its tokens plus the lookahead have been generated."""
        need = self.chunk_end_tokens(chunk_index, prompt_tokens) + self.lookahead_tokens
        return available_tokens >= need
