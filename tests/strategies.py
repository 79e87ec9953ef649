"""Hypothesis strategies shared by the tests (ladders, item specs, whole planning problems).

Imported as ``tests.strategies``.
"""

from __future__ import annotations

from typing import Any

import attrs
from hypothesis import strategies as st

from encgraph.packing import ItemSpec, budget_ladder, normalize_ladder

__all__ = ["ladders", "path_ladders", "item_specs", "problems", "Problem", "sizes"]

PATH_NAMES = ("global", "local", "tiles")


@st.composite
def ladders(draw: Any, *, allow_zero: bool | None = None, max_budget: int = 4096) -> tuple[int, ...]:
    """A normalized ladder: either ``budget_ladder(lo, hi)`` or a random set of budgets, maybe with 0."""
    zero = draw(st.booleans()) if allow_zero is None else allow_zero
    if draw(st.booleans()):
        lo = draw(st.integers(1, max_budget))
        hi = draw(st.integers(lo, max_budget))
        return budget_ladder(lo, hi, allow_zero=zero)
    budgets = draw(st.lists(st.integers(1, max_budget), min_size=1, max_size=6))
    return normalize_ladder(budgets + ([0] if zero else []))


@st.composite
def path_ladders(draw: Any, *, min_paths: int = 1, max_paths: int = 3) -> tuple[Any, tuple[str, ...]]:
    """``(ladders argument, paths)``: a bare ladder (path ``"default"``) or ``{path: ladder}``."""
    n = draw(st.integers(min_paths, max_paths))
    if n == 1 and draw(st.booleans()):
        return draw(ladders()), ("default",)
    names = draw(st.permutations(PATH_NAMES))[:n]
    return {name: draw(ladders()) for name in names}, tuple(names)


@st.composite
def item_specs(
    draw: Any, paths: tuple[str, ...], caps: dict[str, int], *, bare: bool = False, max_frames: int = 6
) -> ItemSpec:
    """An item on ``paths``; token counts reach a bit past each path's largest budget so some overflow."""
    frames = draw(st.integers(1, max_frames))
    input_size = draw(st.none() | st.integers(0, 10_000))
    if bare:
        return ItemSpec(draw(st.integers(1, caps[paths[0]] * 5 // 4 + 1)), frames=frames, input_size=input_size)
    tokens = {p: draw(st.integers(0, caps[p] * 5 // 4 + 1)) for p in paths}
    if not any(tokens.values()):
        tokens[draw(st.sampled_from(paths))] = 1
    return ItemSpec(tokens, frames=frames, input_size=input_size)


@attrs.frozen
class Problem:
    items: list[ItemSpec]
    ladders: Any
    paths: tuple[str, ...]
    max_items: int
    max_frames: int | None


@st.composite
def problems(draw: Any, *, min_paths: int = 1, max_paths: int = 3, max_size: int = 40) -> Problem:
    """A whole valid ``pack`` call: items, ladders and limits."""
    lads, paths = draw(path_ladders(min_paths=min_paths, max_paths=max_paths))
    per_path = lads if isinstance(lads, dict) else {"default": lads}
    caps = {p: max(lad) for p, lad in per_path.items()}
    bare = not isinstance(lads, dict)
    items = draw(st.lists(item_specs(paths, caps, bare=bare), max_size=max_size))
    max_items = draw(st.integers(1, 12))
    max_frames = draw(st.none() | st.integers(max_items, max_items * 6))
    return Problem(items=items, ladders=lads, paths=paths, max_items=max_items, max_frames=max_frames)


def sizes() -> st.SearchStrategy[list[int]]:
    """Per-item sizes for :func:`balance`, with plenty of ties."""
    return st.lists(st.integers(0, 64) | st.sampled_from([0, 100, 1000]), max_size=60)


@st.composite
def cost_models(draw: Any, paths: tuple[str, ...]) -> Any:
    """A :class:`CostModel` of ``paths``: a few measured graph budgets and an eager model, some with large fixed
    costs (eager wins small batches) and some with large per-token costs (graphs win); some paths with an
    attention term (a replay's cost following its sequences' lengths raised to a power, squared for most, floored
    at 0 for some budgets)."""
    from encgraph.packing.costs import CostModel, EagerCost

    graph, eager, attention, power = {}, {}, {}, {}
    for p in paths:
        budgets = draw(st.lists(st.integers(1, 6000), min_size=1, max_size=5, unique=True))
        base = draw(st.floats(0.0, 5.0))
        slope = draw(st.floats(0.0, 0.01))
        graph[p] = {b: base + slope * b + draw(st.floats(0.0, 0.5)) for b in sorted(budgets)}
        fixed, per_token, per_item = draw(st.floats(0.0, 10.0)), draw(st.floats(0.0, 0.02)), draw(st.floats(0.0, 1.0))
        curve = ()
        if draw(st.booleans()):  # a measured one-item curve (what capture builds): launch floor, convex growth
            sizes = sorted(draw(st.lists(st.integers(1, 8000), min_size=2, max_size=5, unique=True)))
            curve = tuple((t, fixed + per_token * t + draw(st.floats(0.0, 1e-5)) * t * t) for t in sizes)
        eager[p] = EagerCost(fixed, per_token, per_item, curve=curve)
        attention[p] = draw(st.sampled_from([0.0, 0.0, 1e-8, 3e-7, 2e-6]))
        power[p] = draw(st.sampled_from([2.0, 2.0, 1.83, 1.5]))
    return CostModel(graph_ms=graph, eager=eager, attention=attention, attention_power=power)
