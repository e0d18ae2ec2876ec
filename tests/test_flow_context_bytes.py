"""`serve.backend.context_bytes_per_s`: the flow context an utterance holds per second of its speech (what
bounds how many utterances stream at once on a GPU) is a per-frame constant: the same after one chunk and
after three, zero before anything is cached, and it counts every Euler step's K/V."""

from __future__ import annotations

from flow_stream_helpers import GRID, LOOKAHEAD, golden_flow_voice

from voicertc.backends.cosyvoice.flow.flow import CausalFlow
from voicertc.backends.cosyvoice.serve.backend import context_bytes_per_s


def test_context_grows_linearly_with_the_speech(tiny_model_dir, tts_golden):
    flow = CausalFlow.from_model_dir(tiny_model_dir)
    state = golden_flow_voice(flow, tts_golden).clone()
    assert context_bytes_per_s(None) == 0.0
    tokens = tts_golden["in_token"]
    pad = -tts_golden["in_prompt_token"].shape[1] % GRID
    flow.stream_step(tokens[:, : pad + 25 + LOOKAHEAD], state, finalize=False)
    after_one = context_bytes_per_s(state)
    offset = pad + 25
    for _ in range(2):
        flow.stream_step(tokens[:, offset : offset + 25 + LOOKAHEAD], state, finalize=False)
        offset += 25
    after_three = context_bytes_per_s(state)
    assert after_one > 0
    assert abs(after_three - after_one) / after_one < 0.1  # bytes per frame, not per chunk
    # at least every Euler step's K and V of both CFG rows, per frame
    est = flow.decoder.estimator
    widths = [m.out_features for n, m in est.named_modules() if n.endswith("attn1.to_q")]
    assert widths  # the estimator's attentions (8 in the tiny one)
    floor = flow.decoder.n_timesteps * 2 * 2 * sum(widths) * 4 * 50  # float32
    assert after_one >= floor, (after_one, floor)
