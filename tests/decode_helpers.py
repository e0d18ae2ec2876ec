"""Decoding sessions to their end on the decode graphs' path: step by step (`decode_batch`, each step
read at once) or ahead (`llm.ahead`, each step launched before the one before is read)."""

from __future__ import annotations

from voicertc.backends.cosyvoice.accel.tape import no_host_syncs
from voicertc.backends.cosyvoice.llm.ahead import DROPPED, DecodeLaunch, can_launch, launch, read
from voicertc.backends.cosyvoice.llm.batch import decode_batch
from voicertc.backends.cosyvoice.llm.graphs import DecodeGraphs
from voicertc.backends.cosyvoice.llm.qwen2lm import LlmSession, Qwen2LM


def decode_stepped(llm: Qwen2LM, graphs: DecodeGraphs, sessions: list[LlmSession]) -> list[list[int]]:
    """Each session's tokens, every step read before the next."""
    out: list[list[int]] = [[] for _ in sessions]
    while not all(s.finished for s in sessions):
        for row, token in zip(out, decode_batch(llm, list(sessions), graphs), strict=True):
            assert not isinstance(token, BaseException)
            if token is not None:
                row.append(token)
    return out


def decode_ahead(
    llm: Qwen2LM, graphs: DecodeGraphs, sessions: list[LlmSession]
) -> tuple[list[list[int]], int, int]:
    """Each session's tokens, every step launched before the one before is read; (tokens, launches
    made behind one in flight, dropped reads). A launch must only queue work: one that syncs the host
    with the device fails (`accel.tape.no_host_syncs`)."""
    out: list[list[int]] = [[] for _ in sessions]
    before: DecodeLaunch | None = None
    behind = dropped = 0
    while True:
        runnable = [s for s in sessions if can_launch(s, graphs)]
        with no_host_syncs():
            now = launch(llm, graphs, runnable, before) if runnable else None
        behind += now is not None and before is not None
        if before is not None:
            for session, token in zip(before.sessions, read(llm, before), strict=True):
                dropped += token == DROPPED
                if token is not None and token != DROPPED:
                    out[sessions.index(session)].append(token)
        if now is None:
            return out, behind, dropped
        before = now
