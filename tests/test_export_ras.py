"""RAS as a logits transform (the vLLM runner's logits processor): the distribution RAS draws from."""

from __future__ import annotations

import torch

from voicertc.backends.cosyvoice.llm.sampling import SamplingParams, sample_token
from voicertc.backends.cosyvoice.llm.vllm.ras import nucleus_mask, ras_logits, repeated_ids

PARAMS = SamplingParams()


def _empirical(
    logits: torch.Tensor, decoded: list[int], draws: int, ban: tuple[int, ...] = ()
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    counts = torch.zeros(logits.shape[0])
    for _ in range(draws):
        counts[
            sample_token(logits, decoded, mode="ras", params=PARAMS, ban_ids=ban, generator=generator)
        ] += 1
    return counts / draws


def _buckets(dist: torch.Tensor) -> torch.Tensor:
    """Ids 0..7 one by one, everything else as one bucket (the long tail is too sparse to compare)."""
    return torch.cat([dist[:8], dist[8:].sum(dim=0, keepdim=True)])


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((_buckets(a) - _buckets(b)).abs().sum())


def _logits() -> torch.Tensor:
    torch.manual_seed(0)
    logits = torch.randn(6564)
    logits[:8] += torch.tensor([9.0, 8.5, 8.0, 7.5, 7.0, 6.0, 5.0, 4.0])
    return logits


def test_nucleus_keeps_the_crossing_token_and_at_most_top_k():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    assert nucleus_mask(probs, PARAMS).tolist() == [True, True, True, False, False]  # 0.85 crosses 0.8
    flat = torch.full((100,), 0.01)
    assert int(nucleus_mask(flat, PARAMS).sum()) == 25


def test_repeated_ids_uses_the_last_window():
    assert repeated_ids([3] + [1] * 10, PARAMS) == [1]
    assert repeated_ids([1, 2, 2], PARAMS) == [1, 2]


def test_matches_the_sampler_without_repeats():
    logits = _logits()
    expected = ras_logits(logits, [100, 200], PARAMS).exp()
    assert abs(float(expected.sum()) - 1.0) < 1e-5
    assert _tv(_empirical(logits, [100, 200], 10000), expected) < 0.02


def test_matches_the_sampler_with_repeats_and_eos_banned():
    logits = _logits()
    logits[6561] += 20.0  # eos would win if it were not banned
    decoded = [0, 1, 0, 300]
    expected = ras_logits(logits, decoded, PARAMS, eos_banned=True).exp()
    assert float(expected[6561]) == 0.0
    assert float(expected[0]) < 0.02  # the top id is almost always rejected (drawn again from p)
    assert _tv(_empirical(logits, decoded, 10000, ban=(6561,)), expected) < 0.02


# ---- RasRows: the vLLM V1 logits-processor state, without vLLM ----------------------------------


class _Params:
    def __init__(self, **extra) -> None:
        self.extra_args = extra


class _Update:
    def __init__(self, added=(), removed=(), moved=()) -> None:
        self.added, self.removed, self.moved = list(added), list(removed), list(moved)


class _Direction:
    def __init__(self, name: str) -> None:
        self.name = name


def test_ras_rows_follow_vllm_batch_updates():
    from voicertc.backends.cosyvoice.llm.vllm.ras import RasRows

    rows = RasRows()
    out_a, out_b = [1, 2], [3]
    rows.update_state(
        _Update(
            added=[
                (0, _Params(ras=True, min_len=4, top_k=7), None, out_a),
                (1, _Params(ras=True), None, out_b),
            ]
        )
    )
    assert rows.rows[0][1] == 4 and rows.rows[0][2].top_k == 7 and rows.rows[1][2].top_k == 25
    rows.update_state(_Update(moved=[(0, 1, _Direction("SWAP"))]))
    assert rows.rows[1][0] is out_a and rows.rows[0][0] is out_b
    rows.update_state(_Update(added=[(2, _Params(), None, [])]))  # a row without RAS is left alone
    assert 2 not in rows.rows
    rows.update_state(_Update(removed=[0], moved=[(1, 0, _Direction("UNIDIRECTIONAL"))]))
    assert set(rows.rows) == {0} and rows.rows[0][0] is out_a
    rows.update_state(_Update(moved=[(5, 0, _Direction("UNIDIRECTIONAL"))]))  # an empty row moved over 0
    assert rows.rows == {}
    rows.update_state(None)


def test_ras_rows_apply_the_ras_distribution_to_their_rows_only():
    from voicertc.backends.cosyvoice.llm.vllm.ras import RasRows

    rows = RasRows()
    logits = _logits().repeat(2, 1)
    plain = logits[1].clone()
    rows.update_state(_Update(added=[(0, _Params(ras=True, min_len=0), None, [5, 5, 5])]))
    out = rows.apply(logits.clone())
    expected = ras_logits(_logits(), [5, 5, 5], SamplingParams(), False)
    torch.testing.assert_close(out[0], expected.to(out.dtype))
    torch.testing.assert_close(out[1], plain)
