"""Reads an official `cosyvoice2.yaml` as plain data, ignoring its hyperpyyaml tags.

`!new:pkg.Class` / `!name:pkg.fn` / `!apply:fn` nodes become their mapping (or list) with the dotted
name kept under the key `"__tag__"`; `!ref <key>` is resolved against the top-level keys, including the
arithmetic the official file uses (`!ref <chunk_size> * <token_mel_ratio>`). Nothing is imported or
constructed, so a shrunk yaml loads the same way as the real one.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from voicertc.errors import ModelDirError

TAG_KEY = "__tag__"
_REF_NAME = re.compile(r"<([A-Za-z_][A-Za-z0-9_.]*)>")


class _Ref:
    def __init__(self, expr: str) -> None:
        self.expr = expr


class _Loader(yaml.SafeLoader):
    pass


def _tagged(loader: _Loader, suffix: str, node: yaml.Node, kind: str) -> Any:
    name = f"{kind}{suffix}"
    if isinstance(node, yaml.MappingNode):
        data = loader.construct_mapping(node, deep=True)
        return {TAG_KEY: name, **data}
    if isinstance(node, yaml.SequenceNode):
        return {TAG_KEY: name, "args": loader.construct_sequence(node, deep=True)}
    return {TAG_KEY: name}


for _kind in ("new:", "name:", "apply:"):
    _Loader.add_multi_constructor(
        f"!{_kind}", lambda loader, suffix, node, k=_kind: _tagged(loader, suffix, node, k)
    )


def _ref(loader: _Loader, node: yaml.ScalarNode) -> _Ref:
    return _Ref(loader.construct_scalar(node))


_Loader.add_constructor("!ref", _ref)


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
}


def _eval_arith(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval_arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_arith(node.left), _eval_arith(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_arith(node.operand)
    raise ValueError("only + - * / on numbers are allowed in a !ref expression")


def _resolve(value: Any, top: dict[str, Any], path: str, depth: int = 0) -> Any:
    if depth > 32:
        raise ModelDirError(f"{path}: !ref chain too deep")
    if isinstance(value, _Ref):
        names = _REF_NAME.findall(value.expr)
        for name in names:
            if name not in top:
                raise ModelDirError(f"{path}: !ref names unknown key {name!r}")
        if _REF_NAME.fullmatch(value.expr.strip()):
            return _resolve(top[names[0]], top, path, depth + 1)
        text = _REF_NAME.sub(lambda m: repr(_resolve(top[m.group(1)], top, path, depth + 1)), value.expr)
        try:
            return _eval_arith(ast.parse(text, mode="eval"))
        except (SyntaxError, ValueError) as exc:
            raise ModelDirError(f"{path}: cannot evaluate !ref {value.expr!r}: {exc}") from exc
    if isinstance(value, dict):
        return {k: _resolve(v, top, f"{path}.{k}", depth) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, top, f"{path}[{i}]", depth) for i, v in enumerate(value)]
    return value


def load_yaml(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The yaml at `path` as plain dicts/lists, tags recorded under `__tag__`, refs resolved."""
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # noqa: S506 - our safe loader
    except OSError as exc:
        raise ModelDirError(f"{path}: cannot read ({exc})") from exc
    except yaml.YAMLError as exc:
        raise ModelDirError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(raw, dict):
        raise ModelDirError(f"{path}: expected a mapping at the top level")
    raw.update(overrides or {})
    return {k: _resolve(v, raw, k) for k, v in raw.items()}


def tag_of(node: Any) -> str:
    """The `new:pkg.Class` tag recorded on a node, or '' when it has none."""
    return node.get(TAG_KEY, "") if isinstance(node, dict) else ""


@dataclass(frozen=True)
class YamlFields:
    """Typed reads of one yaml file's nodes; every error names the file and the key's path."""

    yaml_name: str

    def where(self, path: str, key: str) -> str:
        return f"{self.yaml_name}: {path}.{key}"

    def expect_tag(self, node: Any, tag: str, path: str) -> None:
        if tag_of(node) != tag:
            got = tag_of(node) or type(node).__name__
            raise ModelDirError(f"{self.yaml_name}: {path} must be !{tag}, got {got!r}")

    def sub(self, node: dict[str, Any], key: str, tag: str, path: str) -> dict[str, Any]:
        if key not in node:
            raise ModelDirError(f"{self.where(path, key)} is missing")
        self.expect_tag(node[key], tag, f"{path}.{key}")
        return node[key]

    def int(self, node: dict[str, Any], key: str, path: str, default: int | None = None) -> int:
        value = node.get(key, default)
        if value is None:
            raise ModelDirError(f"{self.where(path, key)} is missing")
        if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
            raise ModelDirError(f"{self.where(path, key)} must be an integer, got {value!r}")
        return int(value)

    def require(self, node: dict[str, Any], key: str, path: str, allowed: Any, default: Any) -> None:
        value = node.get(key, default)
        if value != allowed:
            raise ModelDirError(f"{self.where(path, key)} = {value!r} is not supported (only {allowed!r})")
