"""CosyVoice3's DiT estimator on the captured static-shape path of CosyVoice2's UNet (one mechanism,
two estimators; on CPU uncaptured, `run_eagerly`): a streamed utterance through padded buckets (rows,
frames, cached keys; the conv tails of the 30-frame positional convs taken at the real end; rotary
angles per row as inputs) equals the eager DiT, and two utterances at different positions in one batch
equal each alone."""

from __future__ import annotations

import pytest
import torch

from voicertc.backends.cosyvoice.flow.captured import Buckets, CapturedEstimator
from voicertc.backends.cosyvoice.flow.graph import GraphLayout, StreamingEstimator

TOL = 1e-5
HOPS = (29, 50, 41)  # chunks on the 25-token grid from the 21-token prompt, the last one final


@pytest.fixture(scope="module")
def flow(cv3_model):
    return cv3_model.flow


@pytest.fixture(scope="module")
def g(cv3_records):
    return cv3_records("flow_nonstream.safetensors")


def _stream(flow, g, hops=HOPS) -> torch.Tensor:
    state = flow.init_stream(g["in_prompt_token"].long(), g["in_prompt_feat"], g["in_embedding"])
    tokens, start, mels = g["in_token"].long(), 0, []
    for i, hop in enumerate(hops):
        final = i == len(hops) - 1
        new = tokens[:, start : start + hop if final else start + hop + 3]
        mels.append(flow.stream_step(new, state, finalize=final))
        start += hop
    return torch.cat(mels, dim=2)


def _with(flow, runner, run):
    flow.decoder.estimator_runner = runner
    try:
        return run()
    finally:
        flow.decoder.estimator_runner = None


def test_the_dit_layout_has_one_conv_width_and_every_attention(flow):
    layout = GraphLayout.of(flow.decoder.estimator)
    assert layout.conv_width == 30 and len(layout.conv_slots) == 2 and layout.attention_slots > 0


def test_a_streamed_utterance_through_static_steps_equals_the_eager_dit(flow, g):
    flow.decoder.estimator_runner = None
    eager = _stream(flow, g)
    runner = CapturedEstimator(StreamingEstimator(flow.decoder.estimator), buckets=Buckets(max_rows=4))
    got = _with(flow, runner, lambda: _stream(flow, g))
    assert got.shape == eager.shape
    assert (got - eager).abs().max().item() <= TOL
    assert runner.stats.replays > 0 and runner.stats.eager == 0
    assert all(key[1][1] in (64, 128, 256) for key in runner.stats.by_shape)  # padded chunk frames
    assert len(runner.input_names) == 11  # the UNet's 9 + the rotary angles


def test_two_utterances_at_different_positions_in_one_batch_equal_each_alone(flow, g):
    flow.decoder.estimator_runner = None
    prompt = (g["in_prompt_token"].long(), g["in_prompt_feat"], g["in_embedding"])
    tokens = g["in_token"].long()

    def run() -> list[torch.Tensor]:
        a, b = flow.init_stream(*prompt), flow.init_stream(*prompt)
        first = 29  # the 21-token prompt padded to the grid
        out_a = flow.stream_step(tokens[:, : first + 3], a, finalize=False)
        same = b.pending_prompt.shape[1] + first  # tokens each advances in the shared call
        nxt = [tokens[:, first : first + same + 3], tokens[:, 5 : 5 + first + 3]]
        both = flow.stream_step_batch(nxt, [a, b], finalize=False)
        return [torch.cat([out_a, both[0]], dim=2), both[1]]

    eager = run()
    runner = CapturedEstimator(StreamingEstimator(flow.decoder.estimator), buckets=Buckets(max_rows=4))
    got = _with(flow, runner, run)
    for e, x in zip(eager, got, strict=True):
        assert (x - e).abs().max().item() <= TOL
    assert any(key[0] == 4 for key in runner.stats.by_shape)  # the two-utterance batch
