"""Batched LLM decode: one step for many sessions on the slot K/V cache (`llm.kv`).

Runs on the engine thread. Rows that feed one position on a `SlotKV` row share one batched forward
(replayed from a CUDA graph per batch bucket when `llm.graphs` is given); anything else runs alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.llm.bistream import BistreamSession
from voicertc.backends.cosyvoice.llm.kv import KVSlot
from voicertc.backends.cosyvoice.llm.qwen2lm import LlmSession, Qwen2LM
from voicertc.backends.cosyvoice.llm.sampling import draw_rows

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
    so the tokens are those each session would draw alone. With `graphs` the batched rows run its
    static-shape step (a CUDA graph replay per batch bucket), and the prompts of the `SlotKV` rows share
    one captured prompt step (`DecodeGraphs.prompt_logits`; one ragged eager forward where they fit none:
    on a GPU a prompt costs its launches, not its length, so utterances that start together prefill
    together) and the plain sessions' tokens are drawn
    on the device with one host sync for the batch (`sampling.draw_rows`); without graphs (CPU) each
    prompt is fed alone and each row samples on the host, as before (the official token stream).
    """
    results: list[DecodeResult] = [None] * len(sessions)
    fed: list[int] = []
    batch: list[tuple[int, KVSlot, Tensor]] = []
    prompts: list[tuple[int, KVSlot, Tensor]] = []
    for i, session in enumerate(sessions):
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
            logits = _prompt_logits(llm, graphs, prompts)
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
    drawn = _draw_on_device(llm, sessions, fed) if graphs is not None else {}
    for i in sorted(fed):
        session = sessions[i]
        try:
            if isinstance(session, BistreamSession):
                results[i] = session.accept()
            elif i in drawn:
                results[i] = llm.accept_drawn(session, drawn[i])
            else:
                results[i] = llm.accept(session)
        except Exception as exc:  # noqa: BLE001 - isolated per session
            results[i] = exc
    return results


def _prompt_logits(llm: Qwen2LM, graphs: DecodeGraphs, prompts: list[tuple[int, KVSlot, Tensor]]) -> Tensor:
    """Logits [B, V] of the prompts' last positions: one captured prompt step (`DecodeGraphs.prompt_logits`)
    where they fit one, else one eager forward (`SlotKV.forward_ragged`)."""
    rows, embeds = [p[1] for p in prompts], [p[2] for p in prompts]
    logits = graphs.prompt_logits(rows, embeds)
    if logits is not None:
        return logits
    if len(prompts) == 1:
        return llm.feed(rows[0], embeds[0])[None]
    return llm.llm_decoder(rows[0].pool.forward_ragged(rows, embeds))


def _draw_on_device(
    llm: Qwen2LM, sessions: list[LlmSession | BistreamSession], fed: list[int]
) -> dict[int, int]:
    """The plain sessions' tokens drawn together on the device, read back with one sync (instead of a
    few per row: on a GPU each sync waits for the whole queue)."""
    rows = [i for i in sorted(fed) if isinstance(sessions[i], LlmSession)]
    plain = [s for i in rows if isinstance(s := sessions[i], LlmSession)]
    if not plain:
        return {}
    logits = torch.stack([s.logits for s in plain if s.logits is not None])
    if logits.shape[0] != len(plain):
        return {}
    tokens = draw_rows(
        logits,
        [s.sampling for s in plain],
        [llm.ban_ids(s) for s in plain],
        llm.sampling_params,
        [s.generator for s in plain],
    )
    return dict(zip(rows, tokens.tolist(), strict=True))
