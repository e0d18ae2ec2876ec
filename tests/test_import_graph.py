"""The package's import drawing: no import circle, and no arrow from a lower room up to a higher one.

Every `import` / `from ... import` of a `voicertc` module counts, at module level, inside functions and
under `TYPE_CHECKING` alike (a lazy import is still a dependency). Rooms are the first two name parts
(`voicertc.engine`, `voicertc.backends`, ...); `RANK` orders them from the foundations up to the
composition root (`voicertc.assemble`), and an import may only go to a room of equal or lower rank.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import voicertc

PACKAGE = Path(voicertc.__file__).parent

RANK = {
    "voicertc": 0,  # __version__
    "voicertc.errors": 0,
    "voicertc.config": 1,
    "voicertc.validate": 1,
    "voicertc.voice_ids": 1,
    "voicertc.turn": 1,
    "voicertc.audio": 2,
    "voicertc.engine": 3,
    "voicertc.listen": 3,
    "voicertc.backends": 4,
    "voicertc.remote": 4,
    "voicertc.webrtc": 5,
    "voicertc.streaming": 5,  # one utterance as an async PCM stream (the speech API, the integrations)
    "voicertc.export": 6,
    "voicertc.assemble": 7,
    "voicertc.integrations": 8,  # pipecat / LiveKit adapters: clients of the whole server
}


def module_files() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("voicertc", *path.relative_to(PACKAGE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def import_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.append(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            edges[name] |= {t for t in targets if t in modules and t != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in list(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def room(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    assert cycles(import_edges(module_files())) == []


def test_every_room_has_a_rank():
    assert {room(m) for m in module_files()} <= set(RANK)


def test_no_import_runs_up_to_a_higher_room():
    edges = import_edges(module_files())
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in edges.items()
        for target in targets
        if RANK[room(target)] > RANK[room(source)]
    )
    assert upward == []


def test_the_cosyvoice_wing_has_its_floor_plan():
    wing = PACKAGE / "backends" / "cosyvoice"
    rooms = {p.name for p in wing.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == {"load", "llm", "flow", "hift", "voice", "serve", "accel"}
    assert not any(p.suffix == ".py" and p.name != "__init__.py" for p in wing.iterdir())
