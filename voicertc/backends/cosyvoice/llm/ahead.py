"""Decode ahead: a captured decode step is launched before the host reads the tokens of the one before.

Engine thread, the decode graphs' path (`[engine] cuda_graphs`). Stepping one token at a time and
reading each token back before the next step leaves the GPU idle while the host works: after every
step's sync the host accepts the tokens, does the engine's bookkeeping and prepares the next step's
inputs, and only then launches it (the H100 runs of 2026-11-27: 2.8 ms a replayed step, 4.4-5.0 ms a
token in the engine). Here everything a step needs from the one before stays on the device: the drawn
tokens [B], their embeddings (the next step's input, `DecodeLaunch.next_embeds`) and RAS's repetition
rule (`sampling.ras_on_device`; each launch keeps its rows' last ids with its own, `DecodeLaunch.recent`,
and a session's next launch reads its window there: the ids in flight are in it). In the steady state
(the same sessions as the step before) a launch takes the step before's outputs as they are, with no
host copy. So `launch` queues step k+1 while step k still runs, and `read` of
step k (its event, then host bookkeeping) overlaps step k+1 on the device: at most one unread launch a
session (`LlmSession.unread`).

The host learns a step's tokens one step late, which costs nothing but a step of work for a session
whose token turns out to end it (its next launch is read and dropped) and one token more than a chunk
needs for a session the engine would have paused (it is kept: the next chunk takes it). Which step a
session is at is known on the host without reading (one per launch), so the min_len ban and max_len
hold exactly. The tokens are those `decode_batch` draws with graphs step by step (same draws on the
same generators in the same order: `tests/test_cv2_decode_ahead.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from voicertc.backends.cosyvoice.accel.staging import to_device
from voicertc.backends.cosyvoice.llm.graphs import DecodeGraphs
from voicertc.backends.cosyvoice.llm.kv import KVSlot
from voicertc.backends.cosyvoice.llm.qwen2lm import LlmSession, Qwen2LM
from voicertc.backends.cosyvoice.llm.sampling import draw_rows

DROPPED = -1  # `read`'s result for a session that ended before the step (its step's work is dropped)


@dataclass(eq=False)
class DecodeLaunch:
    """One queued decode step of some sessions (engine thread), not yet read or read."""

    sessions: list[LlmSession]
    tokens: Tensor  # [B] the drawn ids, on the device
    next_embeds: Tensor  # [B, 1, H] each drawn id embedded: the next step's input
    host: Tensor  # [B] int64: the ids on the host once `done` has fired (pinned on CUDA)
    done: torch.cuda.Event | None  # None on a CPU (the ids are there already)
    recent: Tensor  # [B, win_size] each row's last ids with this step's: the next step's RAS window
    read: bool = False

    def row_of(self, session: LlmSession) -> int | None:
        return next((b for b, s in enumerate(self.sessions) if s is session), None)


@dataclass(eq=False)
class DecodeAhead:
    """A Decode unit's decoding ahead (engine thread): its launched step not yet read, which batch row
    each launched session is, and when a step was last read (a step's time, shared by its rows)."""

    launched: DecodeLaunch | None = None
    row_of: dict[int, int] = field(default_factory=dict)  # id(session) -> the unit's batch row
    read_at_s: float = field(default_factory=time.perf_counter)

    @staticmethod
    def owns(session: object, graphs: DecodeGraphs) -> bool:
        """A plain session on the graphs' pool: its steps are launched here (or none while it cannot)."""
        return (
            isinstance(session, LlmSession)
            and isinstance(session.cache, KVSlot)
            and session.cache.pool is graphs.pool
        )


def can_launch(session: LlmSession, graphs: DecodeGraphs) -> bool:
    """Whether `session` can take a launched step: a plain session on the graphs' pool that has not
    ended, has an input (pending, or the token of its launch in flight) and is short of max_len."""
    return (
        isinstance(session.cache, KVSlot)
        and session.cache.pool is graphs.pool
        and not session.finished
        and (session.pending is not None or session.unread > 0)
        and session.unread <= 1
        and len(session.out_tokens) + session.unread < session.max_len
    )


@torch.inference_mode()
def launch(
    llm: Qwen2LM, graphs: DecodeGraphs, sessions: list[LlmSession], before: DecodeLaunch | None = None
) -> DecodeLaunch:
    """Queue one step of `sessions` (each `can_launch`): a session in `before` (launched, maybe not yet
    read) feeds its drawn token, any other its pending input (one position, or a whole prompt: the
    prompt steps). No host sync (the host copies go from pinned memory on CUDA)."""
    if not sessions:
        raise ValueError("launch: no sessions")
    for s in sessions:
        if not can_launch(s, graphs):
            raise ValueError("launch: a session that cannot take a step now (ended, no input, or at max_len)")
    rows = [_input_row(s, before) for s in sessions]
    single = [b for b, s in enumerate(sessions) if rows[b] is not None or _pending(s).shape[1] == 1]
    prompts = [b for b in range(len(sessions)) if b not in single]
    # the steady state: the same sessions as the step before, in its order: its outputs are the inputs
    steady = before is not None and not prompts and rows == list(range(len(before.sessions)))
    parts: list[tuple[list[int], Tensor]] = []
    if single:
        embeds = (
            before.next_embeds
            if steady and before is not None
            else torch.cat([_one_position(sessions[b], rows[b], before) for b in single])
        )
        parts.append((single, graphs.logits([_slot(sessions[b]) for b in single], embeds)))
    if prompts:
        slots, embeds_list = [_slot(sessions[b]) for b in prompts], [_pending(sessions[b]) for b in prompts]
        parts.append((prompts, prompt_logits(llm, graphs, slots, embeds_list)))
    ordered = [sessions[b] for part, _ in parts for b in part]
    logits = torch.cat([p for _, p in parts]) if len(parts) > 1 else parts[0][1]
    window = llm.sampling_params.win_size
    if steady and before is not None:
        recent = before.recent
    else:
        order = [b for part, _ in parts for b in part]
        recent = _recent(ordered, [rows[b] for b in order], before, window, logits.device)
    tokens = draw_rows(
        logits,
        [s.sampling for s in ordered],
        [_ban_ids(llm, s) for s in ordered],
        llm.sampling_params,
        [s.generator for s in ordered],
        recent=recent,
    )
    rows_in_table = llm.speech_embedding.num_embeddings
    next_embeds = llm.speech_embedding(tokens.clamp(max=rows_in_table - 1))[:, None]
    host, done = _to_host(tokens)
    for s in ordered:
        s.pending = None
        s.unread += 1
        s.logits = None
    recent_out = torch.cat([recent[:, 1:], tokens[:, None]], dim=1) if window > 0 else recent
    return DecodeLaunch(ordered, tokens, next_embeds, host, done, recent_out)


def read(llm: Qwen2LM, step: DecodeLaunch) -> list[int | None]:
    """The tokens of a launched step, accepted in its sessions' order (`step.sessions`): the id, None
    where it ends the session (a stop id, or max_len reached with it: the session is finished), or
    `DROPPED` for a session that had already ended (an earlier step's token ended it). Waits for the
    step on the device (its event only: later launches keep running)."""
    if step.read:
        raise ValueError("read: this launch was read already")
    step.read = True
    if step.done is not None:
        step.done.synchronize()
    results: list[int | None] = []
    for b, (session, token) in enumerate(zip(step.sessions, step.host.tolist(), strict=True)):
        session.unread -= 1
        if session.finished:
            results.append(DROPPED)
            continue
        if token in llm.stop_ids:
            session.finished = True
            results.append(None)
            continue
        session.out_tokens.append(token)
        if len(session.out_tokens) >= session.max_len:
            session.finished = True
        elif session.unread == 0:  # no later launch took this token's embedding: it is the next input
            session.pending = step.next_embeds[b : b + 1]
        results.append(token)
    return results


def _input_row(session: LlmSession, before: DecodeLaunch | None) -> int | None:
    """The row of `before` whose drawn token is `session`'s next input (None: its pending input)."""
    if session.unread == 0:
        return None
    row = before.row_of(session) if before is not None and not before.read else None
    if row is None:
        raise ValueError("launch: a session with a step in flight must launch on from that step")
    return row


def _one_position(session: LlmSession, row: int | None, before: DecodeLaunch | None) -> Tensor:
    """`session`'s one-position input [1, 1, H]: its token in flight in `before`, or its pending input."""
    if row is not None and before is not None:
        return before.next_embeds[row : row + 1]
    return _pending(session)


def _pending(session: LlmSession) -> Tensor:
    assert session.pending is not None
    return session.pending


def _slot(session: LlmSession) -> KVSlot:
    assert isinstance(session.cache, KVSlot)
    return session.cache


def _ban_ids(llm: Qwen2LM, session: LlmSession) -> tuple[int, ...]:
    """The ids masked at the step being launched (its index: the tokens read plus those in flight)."""
    return llm.min_len_ban_ids if len(session.out_tokens) + session.unread < session.min_len else ()


def prompt_logits(llm: Qwen2LM, graphs: DecodeGraphs, slots: list[KVSlot], embeds: list[Tensor]) -> Tensor:
    """Logits [B, V] of the prompts' last positions (`embeds` [1, T_b, H] on `slots`): one captured
    prompt step (`DecodeGraphs.prompt_logits`) where they fit one, else one eager forward
    (`SlotKV.forward_ragged`)."""
    logits = graphs.prompt_logits(slots, embeds)
    if logits is not None:
        return logits
    if len(slots) == 1:
        return llm.feed(slots[0], embeds[0])[None]
    return llm.llm_decoder(slots[0].pool.forward_ragged(slots, embeds))


def _recent(
    sessions: list[LlmSession],
    rows: list[int | None],
    before: DecodeLaunch | None,
    window: int,
    device: torch.device,
) -> Tensor:
    """Each session's last `window` ids [B, window] on `device` (-1 where it has fewer): a session in
    `before` (`rows[b]`, its row there) takes that step's window, which holds the ids still in flight;
    any other, the ids read on the host."""
    host = torch.full((len(sessions), window), -1, dtype=torch.long)
    for b, s in enumerate(sessions):
        tail = s.out_tokens[-window:] if window > 0 and rows[b] is None else []
        if tail:
            host[b, window - len(tail) :] = torch.tensor(tail, dtype=torch.long)
    recent = to_device(host, device)
    flight = [b for b, row in enumerate(rows) if row is not None]
    if flight and before is not None and window > 0:
        from_rows = to_device(torch.tensor([rows[b] for b in flight]), device)
        recent.index_copy_(
            0, to_device(torch.tensor(flight), device), before.recent.index_select(0, from_rows)
        )
    return recent


def _to_host(tokens: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """`tokens` copied to pinned host memory behind the queued work, and the event that says it is there."""
    if tokens.device.type != "cuda":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done
