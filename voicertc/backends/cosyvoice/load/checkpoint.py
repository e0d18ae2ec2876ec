"""Strict checkpoint layout checks shared by the llm / flow / hift loaders.

A checkpoint that does not match the module built from `cosyvoice2.yaml` fails before anything is
loaded, with an error naming the file and the offending keys or shapes.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from voicertc.errors import ModelDirError

SHOWN = 3  # keys named per kind of problem


def layout_problems(found: Mapping[str, Tensor], expected: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Human-readable differences between a state dict and the expected {key: shape} layout."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    wrong = [
        f"{k}: file {list(found[k].shape)} vs model {list(shape)}"
        for k, shape in expected.items()
        if k in found and tuple(found[k].shape) != tuple(shape)
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s): {', '.join(missing[:SHOWN])}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s): {', '.join(unexpected[:SHOWN])}")
    if wrong:
        problems.append(f"{len(wrong)} wrong shape(s): {'; '.join(wrong[:SHOWN])}")
    return problems


def check_layout(
    found: Mapping[str, Tensor], expected: Mapping[str, tuple[int, ...]], source_name: str, what: str
) -> None:
    """Raise ModelDirError naming `source_name` when `found` does not match `expected` exactly."""
    problems = layout_problems(found, expected)
    if problems:
        raise ModelDirError(f"{source_name}: does not match the {what}: " + " | ".join(problems))
