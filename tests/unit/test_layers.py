"""The house's layers, read from the sources (``ast``, nothing imported): no import circle among encgraph's modules,
and no module imports a layer above its own.

Every import statement counts, wherever it is: at the top, inside a function (a lazy import), or under
``if TYPE_CHECKING`` (a circle of annotations is still a circle of concepts). Layers, bottom to top:
``encgraph.errors`` and ``encgraph._validate``; ``packing``; ``capture``; ``models`` and ``embedded_towers`` (the
demo towers that both the command line and the server build); then ``cli``, ``serving`` and
``shims`` side by side, never imported by the core, with ``serving`` never importing ``cli``. The package's facade
(``encgraph/__init__.py``, ``__main__.py``) may import anything; only those top layers import it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import encgraph

ROOT = Path(encgraph.__file__).resolve().parent

BOTTOM, PACKING, CAPTURE, MODELS, FRONTS = range(5)
LAYER = {"errors": BOTTOM, "_validate": BOTTOM, "packing": PACKING, "capture": CAPTURE, "models": MODELS,
         "embedded_towers": MODELS, "cli": FRONTS, "serving": FRONTS, "shims": FRONTS}
FACADE = {"encgraph", "encgraph.__main__"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = importer.split(".")
    is_package = MODULES[importer].name == "__init__.py"
    base = package[: len(package) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str) -> set[str]:
    """The encgraph modules ``name`` imports, by any statement anywhere in its source. ``from package import x``
    counts as importing the submodule ``package.x`` where there is one, else the package itself."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            # ``import encgraph.capture.runner`` names the module itself; strip to the longest known module.
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


GRAPH = {name: imports_of(name) for name in MODULES}


def layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYER.get(parts[1]) if len(parts) > 1 else None


def test_the_walk_sees_the_known_edges() -> None:
    # The check is only as good as the walk: top-level, package, lazy and TYPE_CHECKING imports are all seen.
    assert "encgraph.capture.runner" in GRAPH["encgraph.capture"]  # a package's __init__
    assert "encgraph.packing" in GRAPH["encgraph.capture.runner"]  # a package, by ``from package import name``
    assert "encgraph.capture.distributed" in GRAPH["encgraph.capture.runner"]  # inside a function
    assert "encgraph.models.graphed" in GRAPH["encgraph"]  # under ``if TYPE_CHECKING``
    assert all(layer(n) is not None for n in MODULES if n not in FACADE and not n.startswith("encgraph.configs"))


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every back edge of a depth-first walk, as the circle it closes (empty: the graph has no circle)."""
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    return cycles


def test_the_circle_finder_finds_circles() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circles() -> None:
    cycles = find_cycles(GRAPH)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n not in FACADE))
def test_no_module_imports_a_layer_above_its_own(name: str) -> None:
    own = layer(name)
    bad = []
    for target in sorted(GRAPH[name]):
        if target in FACADE:
            if own != FRONTS:
                bad.append(f"{target} (the package facade)")
            continue
        theirs = layer(target)
        if theirs is None or own is None:
            continue
        if theirs > own:
            bad.append(target)
        elif own == FRONTS and theirs == FRONTS and target.split(".")[1] != name.split(".")[1]:
            # Side by side: only the command line may reach into the server (``encgraph serve``).
            if not (name.split(".")[1] == "cli" and target.split(".")[1] == "serving"):
                bad.append(target)
    assert not bad, f"{name} imports a layer above its own: {bad}"
