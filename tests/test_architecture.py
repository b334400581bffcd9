"""The shape of engine/: its modules import each other without cycles.

Every `import` and `from ... import` statement counts, wherever it is: at the top of a module, inside a
function (a call-time import still ties the two modules together) or under `if TYPE_CHECKING:`. Each is
resolved to the engine module it names: `import engine.x.y` and `from engine.x import y` (y a submodule)
import engine.x.y; `from engine.x import name` (name defined in engine/x/__init__.py) imports the package
engine.x, i.e. its __init__. Parent packages that Python initialises on the way are not counted: their
__init__ files import nothing of the engine (engine/__init__.py resolves its public names lazily).

engine/safetensors.py is an alias: it imports engine.formats.safetensors and puts that module in its own
place in sys.modules. Nothing in engine.formats imports it back, so it is an ordinary edge here.
"""
from __future__ import annotations

import ast
from collections import deque
from functools import cache
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine"


def module_name(path: Path) -> str:
    parts = path.relative_to(ENGINE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ENGINE.rglob("*.py"))}


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a (possibly relative) `from` import's module."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imported_modules(module: str) -> set[str]:
    """The engine modules `module` imports anywhere in its source."""
    path = modules()[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    known = modules()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    found.add(alias.name)
                elif alias.name.startswith("engine."):
                    raise AssertionError(f"{path}: `import {alias.name}` names no module of engine/")
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, path.name == "__init__.py", node.level, node.module)
            if base != "engine" and not base.startswith("engine."):
                continue
            if base not in known:
                raise AssertionError(f"{path}: `from {base} import ...` names no module of engine/")
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    found.discard(module)
    return found


@cache
def import_graph() -> dict[str, frozenset[str]]:
    return {m: frozenset(imported_modules(m)) for m in modules()}


def strongly_connected(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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
                    components.append(sorted(component))
    return sorted(components)


def shortest_cycle(graph: dict[str, frozenset[str]], start: str, within: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside one component (breadth first)."""
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node] & within):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if child not in previous:
                previous[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is on no cycle of its component")


def import_cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """For every module on a cycle, the shortest cycle through it (each cycle listed once)."""
    cycles, seen = [], set()
    for component in strongly_connected(graph):
        for module in component:
            cycle = shortest_cycle(graph, module, set(component))
            key = frozenset(zip(cycle, cycle[1:]))
            if key not in seen:
                seen.add(key)
                cycles.append(cycle)
    return cycles


def test_package_inits_import_no_engine_module():
    """What makes leaving out the parent packages sound: initialising one runs no engine import."""
    inits = {m: sorted(import_graph()[m]) for m, path in modules().items() if path.name == "__init__.py"}
    assert {m: deps for m, deps in inits.items() if deps} == {}


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "engine.formats.safetensors" in graph["engine.safetensors"]          # from engine.formats import <module>
    assert "engine.ops.attention" in graph["engine.ops.paged_attention"]         # a top-level from-import
    assert "engine.backend" in graph["engine.plugins"]                           # only inside functions there
    assert "engine.exercises" in graph["engine.exercises.ch03"]                  # from <package> import <name>


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles in engine/:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)
