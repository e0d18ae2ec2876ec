"""Streaming the tiny flow the way the token2wav loop does (shared by the flow runner tests)."""

from __future__ import annotations

import torch

from voicertc.backends.cosyvoice.flow.flow import CausalFlow, FlowStreamState

LOOKAHEAD, GRID = 3, 25


def golden_flow_voice(flow: CausalFlow, tts_golden) -> FlowStreamState:
    return flow.init_stream(
        tts_golden["in_prompt_token"], tts_golden["in_prompt_feat"], tts_golden["in_embedding"]
    )


def stream_golden(flow: CausalFlow, tts_golden, hops: list[int]) -> torch.Tensor:
    """The golden tokens streamed with `hops` (the first padded to the grid), then the final chunk."""
    tokens, state = tts_golden["in_token"], golden_flow_voice(flow, tts_golden).clone()
    offset, mels = 0, []
    pad = -tts_golden["in_prompt_token"].shape[1] % GRID
    for index, hop in enumerate(hops):
        hop += pad if index == 0 else 0
        if offset + hop + LOOKAHEAD > tokens.shape[1]:
            break
        mels.append(flow.stream_step(tokens[:, offset : offset + hop + LOOKAHEAD], state, finalize=False))
        offset += hop
    mels.append(flow.stream_step(tokens[:, offset:], state, finalize=True))
    return torch.cat(mels, dim=2)


def two_utterances(flow: CausalFlow, tts_golden) -> list[torch.Tensor]:
    """A starts a chunk earlier; then A's second and B's first chunk run as one 4-row batch."""
    tokens, voice = tts_golden["in_token"], golden_flow_voice(flow, tts_golden)
    pad = -tts_golden["in_prompt_token"].shape[1] % GRID
    first = pad + 25
    a, b = voice.clone(), voice.clone()
    out_a = [flow.stream_step(tokens[:, : first + LOOKAHEAD], a, finalize=False)]
    same = b.pending_prompt.shape[1] + first  # tokens each advances in the shared call
    a_next = tokens[:, first : first + same + LOOKAHEAD]
    b_first = tokens[:, 5 : 5 + first + LOOKAHEAD]
    mels = flow.stream_step_batch([a_next, b_first], [a, b], finalize=False)
    out_a.append(mels[0])
    tails = [tokens[:, first + same : first + same + 20], tokens[:, 5 + first : 25 + first]]
    final = flow.stream_step_batch(tails, [a, b], finalize=True)
    return [torch.cat([*out_a, final[0]], dim=2), torch.cat([mels[1], final[1]], dim=2)]
