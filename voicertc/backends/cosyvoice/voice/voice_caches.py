"""A voice's prompt caches, built on first use and accounted in bytes.

What a CosyVoice voice costs beyond its features is model state: the flow's stream state after the
prompt (the encoder and estimator K/V of every prompt frame: +3.1 GB for a 6.9 s clip on the full-size
model in fp32 CPU) and the LLM's K/V of [sos, transcript]. `VoiceCaches` builds them the first time an
utterance needs them (on the engine thread), so loading N stored voices at start-up does no model work
and holds no caches; `nbytes` is what they hold (distinct tensor storages, spare K/V room included),
and dropping the voice drops them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from voicertc.backends.cosyvoice.flow.flow import FlowStreamState
    from voicertc.backends.cosyvoice.llm.qwen2lm import PrefixCache


class VoiceCaches:
    """The flow state after the prompt and the LLM prefix of one voice, each built once when first read
    (engine thread)."""

    def __init__(
        self, build_flow: Callable[[], FlowStreamState], build_prefix: Callable[[], PrefixCache]
    ) -> None:
        self._build_flow = build_flow
        self._build_prefix = build_prefix
        self._flow: FlowStreamState | None = None
        self._prefix: PrefixCache | None = None

    @property
    def flow_state(self) -> FlowStreamState:
        if self._flow is None:
            self._flow = self._build_flow()
        return self._flow

    @property
    def prefix(self) -> PrefixCache:
        if self._prefix is None:
            self._prefix = self._build_prefix()
        return self._prefix

    @property
    def built(self) -> bool:
        return self._flow is not None or self._prefix is not None

    def build(self) -> None:
        """Both now (a registration: a bad prompt fails the call that registers it)."""
        _ = self.flow_state, self.prefix

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
