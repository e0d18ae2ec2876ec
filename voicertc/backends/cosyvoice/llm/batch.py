"""Batched LLM decode: one step for many sessions on the slot K/V cache (`llm.kv`).

Runs on the engine thread. Rows that feed one position on a `SlotKV` row share one batched forward
(replayed from a CUDA graph per batch bucket when `llm.graphs` is given); anything else runs alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.llm.ahead import can_launch, launch, prompt_logits, read
from voicertc.backends.cosyvoice.llm.bistream import BistreamSession
from voicertc.backends.cosyvoice.llm.kv import KVSlot
from voicertc.backends.cosyvoice.llm.qwen2lm import LlmSession, Qwen2LM

if TYPE_CHECKING:
    from voicertc.backends.cosyvoice.llm.graphs import DecodeGraphs


DecodeResult = int | None | BaseException


def _prepare(session: LlmSession | BistreamSession) -> Tensor | None:
    """The input the session feeds next (taken from it), or None when it feeds nothing now."""
    if isinstance(session, BistreamSession):
        return session.prepare()
    if session.finished:
        return None
    embeds, session.pending = session.pending, None
    return embeds


@torch.inference_mode()
def decode_batch(
    llm: Qwen2LM, sessions: list[LlmSession | BistreamSession], graphs: DecodeGraphs | None = None
) -> list[DecodeResult]:
    """One LLM step for every session (a token, None, or that session's exception).

    Rows that feed one position on a `SlotKV` row share one batched forward; anything else (a prompt, a
    bistream text segment, a `DynamicCache` session) is fed alone. Each row samples with its own generator,
    so the tokens are those each session would draw alone. With `graphs` the plain sessions on its pool
    take one launched step (`llm.ahead`: the batched rows replay its static-shape step, a CUDA graph per
    bucket; the prompts share one captured prompt step, `DecodeGraphs.prompt_logits`, or one ragged
    eager forward where they fit none: on a GPU a prompt costs its launches, not its length; every token
    drawn on the device, RAS included, `sampling.draw_rows`) read back at once: the step by step form of
    what the engine runs ahead (`CosyVoice2Backend` launches the next step before reading this one).
    Without graphs (CPU) each prompt is fed alone and each row samples on the host (the official token
    stream).
    """
    results: list[DecodeResult] = [None] * len(sessions)
    ahead = [] if graphs is None else [i for i, s in enumerate(sessions) if _launches(s, graphs)]
    if ahead:
        assert graphs is not None
        plain = [s for i in ahead if isinstance(s := sessions[i], LlmSession)]
        try:
            step = launch(llm, graphs, plain)
            tokens = dict(zip(map(id, step.sessions), read(llm, step), strict=True))
            for i in ahead:
                results[i] = tokens[id(sessions[i])]
        except Exception as exc:  # noqa: BLE001 - the rows of this step fail together
            for i in ahead:
                results[i] = exc
    fed: list[int] = []
    batch: list[tuple[int, KVSlot, Tensor]] = []
    prompts: list[tuple[int, KVSlot, Tensor]] = []
    for i, session in enumerate(sessions):
        if i in ahead:
            continue
        try:
            embeds = _prepare(session)
            if embeds is None:
                continue
            if isinstance(session.cache, KVSlot) and embeds.shape[1] == 1:
                batch.append((i, session.cache, embeds))
                continue
            if graphs is not None and isinstance(session.cache, KVSlot) and session.cache.pool is graphs.pool:
                prompts.append((i, session.cache, embeds))
                continue
            session.logits = llm.feed(session.cache, embeds)
            fed.append(i)
        except Exception as exc:  # noqa: BLE001 - isolated per session
            results[i] = exc
    if prompts:
        assert graphs is not None
        try:
            logits = prompt_logits(llm, graphs, [p[1] for p in prompts], [p[2] for p in prompts])
            for row, (i, _, _) in enumerate(prompts):
                sessions[i].logits = logits[row]
                fed.append(i)
        except Exception as exc:  # noqa: BLE001 - the rows of this forward fail together
            for i, _, _ in prompts:
                results[i] = exc
    if batch:
        rows = [b[1] for b in batch]
        embeds = torch.cat([b[2] for b in batch], dim=0)
        if graphs is not None and rows[0].pool is graphs.pool:
            logits = graphs.logits(rows, embeds)
        else:
            logits = llm.llm_decoder(rows[0].pool.forward(rows, embeds)[:, -1])
        for row, (i, _, _) in enumerate(batch):
            sessions[i].logits = logits[row]
            fed.append(i)
    for i in sorted(fed):
        session = sessions[i]
        try:
            results[i] = session.accept() if isinstance(session, BistreamSession) else llm.accept(session)
        except Exception as exc:  # noqa: BLE001 - isolated per session
            results[i] = exc
    return results


def _launches(session: LlmSession | BistreamSession, graphs: DecodeGraphs) -> bool:
    """A plain session on the graphs' pool with nothing in flight: its step goes through `llm.ahead`."""
    return isinstance(session, LlmSession) and session.unread == 0 and can_launch(session, graphs)
