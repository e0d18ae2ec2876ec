"""`accel.tape` (the CPU stand-in for a CUDA graph in every captured-step test): a replay runs the
recorded ops on the recorded tensors, never the step's Python (a step reading Python state replays the
capture's value, as a graph does); an op that may alias (reshape of a transposed tensor: a copy) is run
again, a real view is not; in-place writes and random draws replay; ops that would sync a capturing
stream are refused, in a recording and under `no_host_syncs`."""

from __future__ import annotations

import pytest
import torch

from voicertc.backends.cosyvoice.accel.tape import CaptureSyncError, Tape, TapeCapture, no_host_syncs


def test_a_replay_runs_the_recorded_ops_on_new_input_values_not_the_python():
    weight = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    x = torch.zeros(3, 4)  # a static input: written before each replay
    scale = {"value": 2.0}  # Python state the step reads: baked into the capture

    def step():
        return (torch.relu(x @ weight) * scale["value"],)

    replay = TapeCapture()(step)
    for seed in (1, 2):
        x.copy_(torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)))
        (got,) = replay()
        torch.testing.assert_close(got, torch.relu(x @ weight) * 2.0, rtol=0, atol=0)
    scale["value"] = 5.0
    (got,) = replay()
    torch.testing.assert_close(got, torch.relu(x @ weight) * 2.0, rtol=0, atol=0)  # what a graph keeps
    assert not torch.equal(got, step()[0])  # re-running the Python would have seen the new value


@torch.inference_mode()  # (as the engine runs: reshape then reaches the recorder whole)
def test_an_op_that_copied_where_it_might_have_aliased_is_run_again():
    x = torch.zeros(2, 3, 4)

    def step():
        y = x * 1.0
        return (y.transpose(1, 2).reshape(2, 12) + 0.0, y.reshape(6, 4))  # a copy, then a view

    tape = Tape(step)
    assert [c.func.__name__ for c in tape.calls].count("reshape.default") == 1  # the copy, run again
    x.copy_(torch.arange(24.0).view(2, 3, 4))
    copied, viewed = tape.replay()
    assert torch.equal(copied, x.transpose(1, 2).reshape(2, 12))
    assert torch.equal(viewed, x.reshape(6, 4))


def test_in_place_writes_into_a_cache_and_random_draws_replay():
    cache = torch.zeros(4, 2)
    index = torch.zeros(1, dtype=torch.long)
    value = torch.zeros(1, 2)
    gen = torch.Generator().manual_seed(3)

    def step():
        cache.index_copy_(0, index, value)
        return (torch.rand(2, generator=gen),)

    replay = TapeCapture()(step)
    draws = []
    for row in (1, 3):
        index.fill_(row)
        value.fill_(float(row))
        draws.append(replay()[0].clone())
    assert cache[:, 0].tolist() == [0.0, 1.0, 0.0, 3.0]
    expected = torch.Generator().manual_seed(3)
    want = [torch.rand(2, generator=expected) for _ in range(3)][1:]  # the recording drew first
    assert all(torch.equal(d, w) for d, w in zip(draws, want, strict=True))


@pytest.mark.parametrize(
    "syncing",
    [
        lambda x: x.sum().item(),
        lambda x: x[x > 0],
        lambda x: torch.nonzero(x),
        lambda x: torch.multinomial(x.abs() + 0.1, 1),
        lambda x: torch.repeat_interleave(torch.tensor([1, 2])),
        lambda x: bool((x > 0).any()),
    ],
    ids=["item", "bool-mask", "nonzero", "multinomial", "repeat-interleave", "branch"],
)
def test_ops_that_sync_the_host_are_refused(syncing):
    x = torch.randn(4)
    with pytest.raises(CaptureSyncError):
        Tape(lambda: (syncing(x),))
    with pytest.raises(CaptureSyncError), no_host_syncs():
        syncing(x)
    with no_host_syncs():  # what only queues work passes
        torch.where(x > 0, x, 0.0).cumsum(0).argmax()
