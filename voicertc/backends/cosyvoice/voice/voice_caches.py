"""A voice's prompt caches, built on first use in bounded parts and accounted in bytes.

What a CosyVoice voice costs beyond its features is model state: the flow's stream state after the
prompt (the encoder and estimator K/V of every prompt frame: +3.1 GB for a 6.9 s clip on the full-size
model in fp32 CPU) and the LLM's K/V of [sos, transcript]. `VoiceCaches` builds them the first time an
utterance needs them (on the engine thread), so loading N stored voices at start-up does no model work
and holds no caches; `nbytes` is what they hold (distinct tensor storages, spare K/V room included),
and dropping the voice drops them.

Building them is seconds of model work on a CPU (the flow's ten Euler steps over every prompt frame),
longer than an engine unit may take, so it goes in parts (`advance`: the prompt streamed a grid chunk at
a time, each chunk's encoder pass then its estimator stages or Euler steps, then the LLM prefix a decoder
layer at a time) that the engine interleaves with the other calls' units: a registration (an engine
command in parts) or a stored voice's first utterance (its `VoicePrompt` units) advance the same build,
whichever comes first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from voicertc.engine.parts import Parts

if TYPE_CHECKING:
    from voicertc.backends.cosyvoice.flow.flow import FlowStreamState
    from voicertc.backends.cosyvoice.llm.qwen2lm import PrefixCache


class VoiceCaches:
    """The flow state after the prompt and the LLM prefix of one voice, each built once (engine thread).

    `flow_parts` and `prefix_parts` check their inputs when called (before any part) and return the
    builds as parts."""

    def __init__(
        self,
        flow_parts: Callable[[], Parts[FlowStreamState]],
        prefix_parts: Callable[[], Parts[PrefixCache]],
    ) -> None:
        self._flow_parts = flow_parts
        self._prefix_parts = prefix_parts
        self._flow: FlowStreamState | None = None
        self._prefix: PrefixCache | None = None
        self._building: Parts[None] | None = None  # the build in progress, shared by whoever advances it
        self.parts_run = 0  # parts advanced so far (tests, logs)

    @property
    def flow_state(self) -> FlowStreamState:
        self._finish()
        assert self._flow is not None
        return self._flow

    @property
    def prefix(self) -> PrefixCache:
        self._finish()
        assert self._prefix is not None
        return self._prefix

    @property
    def built(self) -> bool:
        """Some of it is built (it holds memory)."""
        return self._flow is not None or self._prefix is not None

    @property
    def ready(self) -> bool:
        """All of it is built: an utterance can start without model work for its voice."""
        return self._flow is not None and self._prefix is not None

    def build(self) -> None:
        """All of it now, in the caller's context."""
        self._finish()

    def check(self) -> None:
        """Check the prompt and the transcript ids (what `flow_parts` and `prefix_parts` check before
        their first part) and start the build, so a bad prompt fails here, before any model work."""
        if not self.ready and self._building is None:
            self._building = self._parts()

    def advance(self) -> bool:
        """The next part of the build (under `torch.inference_mode`); whether everything is built. A
        part that raises abandons the build (the next call starts afresh) and raises to its caller."""
        if self.ready:
            return True
        self.check()
        assert self._building is not None
        try:
            with torch.inference_mode():
                next(self._building)
        except StopIteration:
            self._building = None
            return True
        except BaseException:
            self._building = None
            raise
        self.parts_run += 1
        return False

    def _finish(self) -> None:
        while not self.advance():
            pass

    def _parts(self) -> Parts[None]:
        flow_parts = self._flow_parts() if self._flow is None else None  # check the prompt now
        prefix_parts = self._prefix_parts() if self._prefix is None else None
        return self._build(flow_parts, prefix_parts)

    def _build(
        self, flow_parts: Parts[FlowStreamState] | None, prefix_parts: Parts[PrefixCache] | None
    ) -> Parts[None]:
        if flow_parts is not None:
            self._flow = yield from flow_parts
            yield
        if prefix_parts is not None:
            self._prefix = yield from prefix_parts

    def nbytes(self) -> int:
        """Bytes of the built caches (0 before first use)."""
        return tensor_bytes([self._flow, self._prefix])


def tensor_bytes(root: object) -> int:
    """Bytes of the distinct tensor storages reachable from `root` through dataclass fields, object
    attributes, lists, tuples and dicts (a storage shared by several tensors counts once)."""
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, str | bytes | int | float | bool) or id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, list | tuple | set):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif dataclasses.is_dataclass(obj):
            stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return sum(storages.values())
