"""RAS as a logits transform, for runtimes that only sample (vLLM: no RAS, cosyvoice.md §3.2, §6.4.12).

Repetition-aware sampling draws x from the nucleus q (top-p 0.8, at most top-k 25, the crossing token
kept); if x occurs in the last `win_size` decoded tokens at least `win_size * tau_r` times, it draws again
from the full distribution p with x banned. The result has the closed form

    P(y) = q(y) [y not repeated] + sum over repeated x of q(x) * p(y) [y != x] / (1 - p(x)),

so returning log P as logits and letting the runtime sample plainly (temperature 1, no top-k/top-p)
draws from exactly the distribution RAS draws from. `eos_banned` applies the official min-length rule
(the score of 6561 set to -inf before sampling) to both p and q.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.llm.sampling import SamplingParams

EOS_ID = 6561


def repeated_ids(decoded: Sequence[int], params: SamplingParams) -> list[int]:
    """Ids whose draw RAS would reject: occurring >= win_size * tau_r times in the last win_size."""
    window = list(decoded[-params.win_size :]) if params.win_size > 0 else []
    threshold = params.win_size * params.tau_r
    return sorted({t for t in window if window.count(t) >= threshold})


def nucleus_mask(probs: Tensor, params: SamplingParams) -> Tensor:
    """Bool [V]: the tokens the official nucleus loop keeps (sorted descending, stable)."""
    # probs: [V] -> [V] bool
    sorted_probs, order = probs.sort(descending=True, stable=True)
    head = sorted_probs[: params.top_k].float()
    before = torch.cumsum(head, 0) - head  # running sum before adding each token
    keep = before < params.top_p
    keep = keep & (
        torch.cumsum(keep.to(torch.int64), 0) == torch.arange(1, head.numel() + 1, device=head.device)
    )
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[order[: params.top_k][keep]] = True
    return mask


def ras_logits(
    logits: Tensor, decoded: Sequence[int], params: SamplingParams, eos_banned: bool = False
) -> Tensor:
    """Log of RAS's sampling distribution for one row of raw logits [V] (float32 out)."""
    logp = logits.float().log_softmax(dim=-1)
    if eos_banned:
        logp[EOS_ID] = -float("inf")
    p = logp.softmax(dim=-1)
    keep = nucleus_mask(p, params)
    q = torch.where(keep, p, torch.zeros_like(p))
    q = q / q.sum()
    out = q.clone()
    for x in repeated_ids(decoded, params):
        if q[x] <= 0:
            continue
        out[x] -= q[x]
        rest = p.clone()
        rest[x] = 0.0
        out += q[x] * rest / rest.sum()
    return out.clamp_min(0).log()


class RasRows:
    """The state of vLLM's V1 logits-processor interface for RAS, without vLLM (CPU-testable).

    `update_state` follows a `BatchUpdate` (removed, then added `(index, params, ..., output_ids)`, then
    moved `(source, target, direction)`); rows whose `SamplingParams.extra_args` carry `ras` get their
    logits replaced by the log of RAS's distribution in `apply`. The RAS parameters travel in
    `extra_args` too (the processor is built inside vLLM's engine process, which has no yaml).
    `vllm_logits.RasLogitsProcessor` is this on vLLM's base class.
    """

    def __init__(self) -> None:
        # batch index -> (output ids, min_len, RAS parameters)
        self.rows: dict[int, tuple[list[int], int, SamplingParams]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for added in batch_update.added:
            index, params, output_ids = added[0], added[1], added[-1]
            extra = getattr(params, "extra_args", None) or {}
            if extra.get("ras"):
                ras = SamplingParams(
                    top_p=float(extra.get("top_p", 0.8)),
                    top_k=int(extra.get("top_k", 25)),
                    win_size=int(extra.get("win_size", 10)),
                    tau_r=float(extra.get("tau_r", 0.1)),
                )
                self.rows[index] = (output_ids, int(extra.get("min_len", 0)), ras)
            else:
                self.rows.pop(index, None)
        for source, target, direction in batch_update.moved:
            moved = self.rows.pop(source, None)
            other = self.rows.pop(target, None)  # a one-way move overwrites the target
            if moved is not None:
                self.rows[target] = moved
            if other is not None and getattr(direction, "name", str(direction)).endswith("SWAP"):
                self.rows[source] = other

    def apply(self, logits: Tensor) -> Tensor:
        for index, (output_ids, min_len, params) in self.rows.items():
            if index < logits.shape[0]:
                row = ras_logits(logits[index], output_ids, params, len(output_ids) < min_len)
                logits[index] = row.to(logits.dtype)
        return logits
