"""A CPU stand-in for a CUDA graph: the aten ops a static step ran, replayed without its Python.

Runs on the engine thread. A CUDA graph replays the kernels its capture launched, on the same memory,
whatever the step's Python would do now: a step whose Python reads state that changes between calls
(a row's length, a counter, a dict) replays the values the capture saw, and an op that syncs the host
with the device (`.item()`, a boolean mask's `nonzero`, `multinomial`) fails the capture. `run_eagerly`
re-runs the Python at every call, so a CPU test through it sees neither. `TapeCapture` does on a CPU what
a capture does: it runs the step once under a dispatch mode that records every aten op with its
arguments, refusing the ops that would sync a capturing stream (`CaptureSyncError`), and each replay runs
the recorded ops again on the same tensors: an in-place op in place, an op that made a tensor into the
tensor the recording made (the graph's memory), a view not at all (it aliases memory the replay writes).
Random ops draw again from their generators, as a replayed graph's do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

Outputs = tuple[Tensor, ...]
Step = Callable[[], Outputs]

# ops whose kernels read device memory back to the host (or size their output by it): a capturing stream
# refuses them (the CUDA error "operation not permitted when stream is capturing")
_SYNCING_OPS = frozenset(
    {
        "_local_scalar_dense",  # .item(), int(t), bool(t)
        "is_nonzero",
        "equal",
        "nonzero",
        "masked_select",
        "multinomial",  # two host syncs a call on CUDA
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "argwhere",
    }
)
_BOOL_INDEXED = frozenset({"index", "index_put_", "_index_put_impl_", "index_put"})


class CaptureSyncError(RuntimeError):
    """The step did something a CUDA graph capture refuses (a host sync, a shape set by values)."""


@dataclass
class _Call:
    func: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any  # what the recording returned: the replay writes a made tensor back into it
    kind: str  # "inplace" (mutates an argument: run again), "view" (aliases one: skipped), "made" (run again,
    # its result copied into the recorded tensor)


def _kind(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> str:
    if func._schema.is_mutable:
        return "inplace"
    # an op that may alias (reshape, contiguous, flatten: a view when the strides allow, else a copy)
    # is a view only where its result shares an argument's memory
    given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
    made = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
    if made and all(t.untyped_storage().data_ptr() in given for t in made):
        return "view"
    return "made"


def _refuse_syncs(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    name = func.overloadpacket.__name__
    if name in _SYNCING_OPS:
        raise CaptureSyncError(f"aten.{name} syncs with the host: a CUDA graph cannot capture it")
    if name == "repeat_interleave" and isinstance(args[-1] if args else None, Tensor):
        if kwargs.get("output_size") is None:
            raise CaptureSyncError("aten.repeat_interleave by a tensor without output_size syncs")
    if name in _BOOL_INDEXED and len(args) > 1:
        indices, _ = tree_flatten(args[1])
        if any(isinstance(t, Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices):
            raise CaptureSyncError(f"aten.{name} with a boolean mask syncs (its nonzero)")


class _RefuseSyncs(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _refuse_syncs(func, args, kwargs)
        return func(*args, **kwargs)


def no_host_syncs() -> TorchDispatchMode:
    """A context in which an op that would sync the host with the device raises `CaptureSyncError`
    (the CPU check of code that must only queue work: a decode launch, a captured step's inputs).
    Device-to-host copies cannot be told from host copies on a CPU: those are the GPU tests' to find."""
    return _RefuseSyncs()


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _refuse_syncs(func, args, kwargs)
        out = func(*args, **kwargs)
        self.calls.append(_Call(func, args, kwargs, out, _kind(func, args, kwargs, out)))
        return out


class Tape:
    """One step's recorded ops and the outputs the recording returned (overwritten by each replay)."""

    def __init__(self, step: Step) -> None:
        recorder = _Recorder()
        with recorder:
            self.outputs = step()
        # the tensors a view made are kept alive by the view itself; every other call is re-run
        self.calls = [call for call in recorder.calls if call.kind != "view"]

    def __len__(self) -> int:
        return len(self.calls)

    def replay(self) -> Outputs:
        with torch.inference_mode():
            for call in self.calls:
                result = call.func(*call.args, **call.kwargs)
                if call.kind == "made":
                    _write_back(call.out, result)
        return self.outputs


def _write_back(recorded: Any, result: Any) -> None:
    recorded_flat, _ = tree_flatten(recorded)
    result_flat, _ = tree_flatten(result)
    for old, new in zip(recorded_flat, result_flat, strict=True):
        if isinstance(old, Tensor):
            if old.shape != new.shape:  # a shape set by values: no graph replays it
                raise CaptureSyncError(
                    f"a replayed op made {tuple(new.shape)} where the capture made {tuple(old.shape)}"
                )
            if old is not new:
                old.copy_(new)


class TapeCapture:
    """`accel.captured.Capture` on a CPU: each step recorded once (`Tape`) and replayed from its ops.
    Counts captures and replays (the tests read them)."""

    def __init__(self) -> None:
        self.captured = 0
        self.replays = 0
        self.ops = 0  # recorded ops, every capture together

    def __call__(self, step: Step) -> Step:
        tape = Tape(step)
        self.captured += 1
        self.ops += len(tape)

        def replay() -> Outputs:
            self.replays += 1
            return tape.replay()

        return replay
