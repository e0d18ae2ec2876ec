"""Speech-token sampling of the CosyVoice2 LLM: repetition-aware sampling (RAS) over a nucleus, or greedy.

RAS is the official `ras_sampling` (VALL-E 2): draw from the nucleus (top-p 0.8, at most top-k 25, the token
that crosses top-p included); if the drawn id already occurs in the last `win_size` decoded tokens at least
`win_size * tau_r` times, ban it and draw again from the whole distribution. The random draws are made with
`torch.multinomial` on tensors of the same size and dtype as the official code, so a run after
`torch.manual_seed(s)` (CPU) reproduces the official tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from voicertc.backends.cosyvoice.accel.staging import to_device
from voicertc.errors import ModelDirError

SamplingMode = Literal["ras", "greedy"]


@dataclass(frozen=True)
class SamplingParams:
    """The yaml `llm.sampling` node (`!name:cosyvoice.utils.common.ras_sampling`)."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1

    @classmethod
    def from_yaml(cls, node: Any) -> SamplingParams:
        if node is None:
            return cls()
        if not isinstance(node, dict):
            raise ModelDirError(f"cosyvoice2.yaml: llm.sampling should be a mapping, got {node!r}")
        tag = node.get("__tag__", "")
        if tag and not tag.endswith("ras_sampling"):
            raise ModelDirError(f"cosyvoice2.yaml: llm.sampling is {tag!r}; only ras_sampling is supported")
        defaults = cls()
        return cls(
            top_p=float(node.get("top_p", defaults.top_p)),
            top_k=int(node.get("top_k", defaults.top_k)),
            win_size=int(node.get("win_size", defaults.win_size)),
            tau_r=float(node.get("tau_r", defaults.tau_r)),
        )


def nucleus_size(sorted_probs: Tensor, top_p: float, top_k: int) -> int:
    """How many of the sorted probabilities the official loop keeps.

    A token is added while the running float32 sum is below top_p and fewer than top_k are kept, so
    the token that crosses top_p is included.
    """
    head = sorted_probs[:top_k].float().cpu().numpy()
    limit = np.float32(top_p)
    cum = np.float32(0.0)
    count = 0
    for p in head:
        if not (cum < limit and count < top_k):
            break
        cum = np.float32(cum + p)
        count += 1
    return count


def ras_sample(
    logp: Tensor,
    decoded_tokens: list[int],
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> int:
    """One RAS draw from log-probabilities `logp` [V] (eos already masked when required)."""
    # logp: [V] float -> one token id
    probs_sorted, ids_sorted = logp.softmax(dim=0).sort(descending=True, stable=True)
    n = nucleus_size(probs_sorted, params.top_p, params.top_k)
    pick = torch.multinomial(probs_sorted[:n], 1, replacement=True, generator=generator)
    token = int(ids_sorted[pick].item())
    if ras_repeats(token, decoded_tokens, params):
        banned = logp.clone()
        banned[token] = -float("inf")
        token = int(torch.multinomial(banned.softmax(dim=0), 1, replacement=True, generator=generator).item())
    return token


def greedy_sample(logp: Tensor) -> int:
    """Argmax (first index on ties), what the official sampler gives with top_k=1."""
    return int(torch.argmax(logp).item())


def sample_token(
    logits: Tensor,
    decoded_tokens: list[int],
    *,
    mode: SamplingMode,
    params: SamplingParams,
    ban_ids: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
) -> int:
    """Official `sampling_ids`: log-softmax of the raw logits [V], banned ids set to -inf, then sample."""
    logp = logits.float().log_softmax(dim=-1)
    if ban_ids:
        logp[list(ban_ids)] = -float("inf")
    if mode == "greedy":
        return greedy_sample(logp)
    if mode == "ras":
        return ras_sample(logp, decoded_tokens, params, generator)
    raise ValueError(f"unknown sampling mode {mode!r} (expected 'ras' or 'greedy')")


def draw_rows(
    logits: Tensor,
    modes: list[SamplingMode],
    bans: list[tuple[int, ...]],
    params: SamplingParams,
    generators: list[torch.Generator | None],
    recent: Tensor | None = None,
) -> Tensor:
    """One draw per row of `logits` [B, V] without a host sync: token ids [B] on the logits' device.

    The decode graphs' path (`llm.batch.decode_batch` with graphs): the nucleus is found on the device
    (float32 cumulative sum of the sorted probabilities; a token is kept while the sum before it is
    under top_p, at most top_k: `nucleus_size`'s rule) and each row draws from it with its own
    generator, so a row's token does not depend on the others in the batch. Greedy rows: argmax.
    `recent` [B, win_size] (each row's last decoded ids, -1 where it has fewer): RAS's repetition rule
    on the device too (`ras_on_device`); None: no repetition rule (the caller applies it)."""
    logp = logits.float().log_softmax(dim=-1)
    for ban in {ban for ban in bans if ban}:  # (one in practice: end of speech before min_len)
        # device indices and row masks made once per pattern (a host list is a copy and a stream sync)
        columns = ban_index(ban, logp.device)
        if all(row_ban == ban for row_ban in bans):
            logp.index_fill_(1, columns, -float("inf"))
        else:
            rows = row_mask(tuple(row_ban == ban for row_ban in bans), logp.device)
            banned = logp.index_select(1, columns).masked_fill_(rows[:, None], -float("inf"))
            logp.index_copy_(1, columns, banned)
    greedy = logp.argmax(dim=-1)
    drawing = [b for b, mode in enumerate(modes) if mode != "greedy"]
    if not drawing:
        return greedy
    probs_sorted, ids_sorted = logp.softmax(dim=-1).sort(dim=-1, descending=True, stable=True)
    head = probs_sorted[:, : params.top_k]
    before = head.cumsum(dim=-1) - head  # the running sum before each token
    weights = head * (before < params.top_p)
    # `draw_one` for every drawing row at once: each row's Exp(1) variates from its own generator (one
    # launch a row: the generators are per utterance), the divide / argmax / gather batched
    variates = torch.ones_like(weights)
    for b in drawing:
        variates[b].exponential_(1, generator=generators[b])
    drawn = ids_sorted.gather(1, (weights / variates).argmax(dim=-1, keepdim=True)).squeeze(1)
    if recent is not None:
        drawn = ras_on_device(logp, drawn, recent, params, generators, drawing)
    if len(drawing) == len(modes):
        return drawn
    return torch.where(row_mask(tuple(mode == "greedy" for mode in modes), logp.device), greedy, drawn)


def ras_on_device(
    logp: Tensor,
    drawn: Tensor,
    recent: Tensor,
    params: SamplingParams,
    generators: list[torch.Generator | None],
    drawing: list[int],
) -> Tensor:
    """RAS's repetition rule for the rows `drawing` of a batch without a host sync (`generators[b]`:
    row b's): where a row's drawn id occurs at least win_size * tau_r times in its `recent` ids, its
    token is redrawn from the whole distribution (`logp` [B, V], bans applied) with that id banned.
    The redraw's Exp(1) variates are made for every drawing row whether it repeats or not (which rows
    repeat is known only on the device), so a row's generator moves on by the same amount at every
    step: its tokens depend on its own seed and history alone, never on the rows beside it; they are
    the host rule's in distribution, not its draws (`ras_sample` consumes the generator only when it
    redraws). -> tokens [B]."""
    repeats = (recent == drawn[:, None]).sum(dim=1) >= params.win_size * params.tau_r  # [B]
    banned = logp.scatter(1, drawn[:, None], -float("inf"))
    variates = torch.ones_like(banned)
    for b in drawing:
        variates[b].exponential_(1, generator=generators[b])
    redrawn = (banned.softmax(dim=-1) / variates).argmax(dim=-1)
    return torch.where(repeats, redrawn, drawn)


def row_mask(rows: tuple[bool, ...], device: torch.device) -> Tensor:
    """Rows of a batch (those that draw greedily, those with a ban) as a mask on `device`, copied from
    pinned memory behind the queued work (a pageable copy would wait for the decode step in flight; a
    cache shared by the engine and the LLM streamer would free a tensor another stream still reads)."""
    return to_device(torch.tensor(rows, dtype=torch.bool), device)


def ban_index(ban: tuple[int, ...], device: torch.device) -> Tensor:
    """The banned ids as an index tensor on `device` (as `row_mask`)."""
    return to_device(torch.tensor(ban, dtype=torch.long), device)


def draw_one(weights: Tensor, generator: torch.Generator | None) -> Tensor:
    """`torch.multinomial(weights, 1)` for non-negative `weights` [V] without its validity checks (two
    host syncs on CUDA per call): the draw ATen makes for one sample, an Exp(1) variate per entry and
    the argmax of weight / variate, so the same generator state gives the same id and the same next
    state (`tests/test_draw_one.py`). -> [1] index into `weights`."""
    q = torch.empty_like(weights).exponential_(1, generator=generator)
    return (weights / q).argmax(dim=-1, keepdim=True)


def ras_repeats(token: int, decoded_tokens: list[int], params: SamplingParams) -> bool:
    """RAS's rule: the drawn id occurs at least win_size * tau_r times in the last win_size tokens."""
    window = decoded_tokens[-params.win_size :] if params.win_size > 0 else []
    return sum(1 for t in window if t == token) >= params.win_size * params.tau_r
