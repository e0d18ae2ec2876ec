"""ChunkSchedule: when the flow may run, as a pure function of the chunk index.

Shared and immutable: every utterance starts at its own first hop (the reference stores the growing
hop on the shared model and never resets it, so later requests start at the largest hop).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkSchedule:
    first_hop_tokens: int = 25
    growth: int = 2
    max_hop_tokens: int = 100
    lookahead_tokens: int = 3

    def __post_init__(self) -> None:
        if self.first_hop_tokens < 1:
            raise ValueError("first_hop_tokens must be >= 1")
        if self.growth < 1:
            raise ValueError("growth must be >= 1")
        if self.max_hop_tokens < self.first_hop_tokens:
            raise ValueError("max_hop_tokens must be >= first_hop_tokens")
        if self.lookahead_tokens < 0:
            raise ValueError("lookahead_tokens must be >= 0")

    def hop_tokens(self, chunk_index: int) -> int:
        """Tokens emitted by chunk `chunk_index` (before the first chunk's prompt padding)."""
        return min(self.max_hop_tokens, self.first_hop_tokens * self.growth**chunk_index)

    def prompt_pad_tokens(self, prompt_tokens: int) -> int:
        """Extra tokens in the first chunk so that its end lands on the first-hop grid counted from
        the prompt start (the flow's chunk masks are anchored there)."""
        grid = self.first_hop_tokens
        return -prompt_tokens % grid

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
