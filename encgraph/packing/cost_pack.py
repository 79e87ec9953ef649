"""The cost-aware planner: the batch split and graph-vs-eager choice of least expected time.

:func:`encgraph.packing.pack` delegates here when given ``costs=`` (a :class:`CostModel`).  Pure (numpy, no torch).

Algorithm (deterministic, ``O(n * L)`` for ``n`` items and runs of at most ``L`` items):

1. Items are sorted ascending by total tokens, ties in input order (the greedy planner's order).  An item over
   some path's largest budget, or with more frames than ``max_frames``, sits alone as in the greedy planner.
2. The other items keep that order; every contiguous run of them that fits ``max_items``, ``max_frames`` and
   every path's largest budget is a candidate batch.  Its cost is, per path, that of the graph of the smallest
   budget that holds its tokens or of an eager run (:attr:`EagerReason.COST` when eager's expected time times
   :data:`EAGER_MARGIN` is under the graph's); 0 on a path with no tokens.  Where the model has an attention
   coefficient for the path, the graph's cost follows the run's content
   (:func:`~encgraph.packing.attention_term.with_squares`: the items' ``frames * (tokens / frames)^q`` and the
   padding's ``(budget - tokens)^q`` at the path's power ``q``, 2 unless measured), so that several large images
   may share one larger replay when that is cheaper than one replay each.  The costs of all runs are computed at
   once with numpy.
3. Dynamic programming over run ends picks the split of least total cost (ties: the shorter last run).
   Greedy's batches are such runs, so the result never costs more than the greedy plan under the same model.
4. Batches come out in the sorted order of their first item, lone items in place.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate
from operator import add
from typing import Any, NamedTuple

import numpy as np

from encgraph._validate import describe
from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing.attention_term import item_term, with_squares
from encgraph.packing.costs import CostModel, EagerCost
from encgraph.packing.plan import Batch, EagerReason, _fast_batch

__all__ = ["EAGER_MARGIN", "check_costs", "cost_batches"]

EAGER_MARGIN = 1.05
"""An eager run is chosen over a replay only when its expected time times this is under the replay's: an eager
forward's time moves with the host (launches, the GIL, the allocator) where a replay's does not, and measured at
capture it read low. SigLIP-so400m's compiled eager forward of 16 images was predicted 26.3 ms against the replay's
26.8 (2% under) and took 28.5 in calls on an H200 (an H100 at 32: 50.05 predicted against 50.41, 52.8 taken): with
no margin the planner sent every such batch eagerly, 0.89x torch.compile's reduce-overhead at 32 images. Kept
small: where eager truly wins by less (a long image's dense attention; PaddleOCR-VL's 11,772-row sample read 3%
low), the replay costs at most this much more."""


def _eager_wins(eager_ms: Any, graph_ms: Any) -> Any:
    """The one choice rule, on floats or elementwise on numpy arrays (the same product and comparison either
    way, so the dynamic programme and the batches it builds agree): eager only under the replay by the margin."""
    return eager_ms * EAGER_MARGIN < graph_ms


_COST = EagerReason.COST
_TOKENS = EagerReason.TOKENS
_FRAMES = EagerReason.FRAMES


def check_costs(costs: object, paths: Sequence[str], where: str = "pack") -> CostModel:
    """``costs`` as a :class:`CostModel` covering every one of ``paths``; clear errors otherwise."""
    if not isinstance(costs, CostModel):
        raise ConfigTypeError(
            f"{where}(costs): expected a CostModel or None, got {describe(costs)}. Build one with "
            f"CostModel.from_measurements(...) or CostModel.load(path), or pass None for the greedy plan."
        )
    missing = [p for p in paths if p not in costs.graph_ms]
    if missing:
        raise ConfigError(
            f"{where}(costs): missing path {missing[0]!r}; expected a model of every path {list(paths)}, got "
            f"{list(costs.paths)}. Measure {missing[0]!r} too."
        )
    return costs


class _PathTable(NamedTuple):
    """One path's costs under one ladder, as the planner reads them (built once per model, path and ladder)."""

    ladder: tuple[int, ...]
    graph: tuple[float, ...]  # graph replay ms per budget of ``ladder``
    ladder_np: np.ndarray  # (L,) int64, ``ladder``
    graph_np: np.ndarray  # (L,) float64, ``graph``
    eager: EagerCost
    att: float  # ms per token^power (0.0: replays cost ``graph``)
    ladder_sq_np: np.ndarray  # (L,) float64, ``ladder`` raised to ``power``
    power: float  # the attention term's power (2.0 unless measured otherwise)


def _table(costs: CostModel, path: str, ladder: tuple[int, ...]) -> _PathTable:
    key = (path, ladder)
    out = costs._table_cache.get(key)
    if out is None:
        graph = costs._ladder_costs(path, ladder)
        e = costs.eager[path]
        lad = np.asarray(ladder, dtype=np.int64)
        out = costs._table_cache[key] = _PathTable(
            ladder, graph, lad, np.asarray(graph, dtype=np.float64), e, costs.attention.get(path, 0.0),
            lad.astype(np.float64) ** costs.power(path), costs.power(path),
        )
    return out


def _graph(tab: _PathTable, k: int, t: int, sq: float) -> float:
    """The graph cost of budget ``tab.ladder[k]`` for ``t`` tokens whose items' terms (:func:`item_term`) sum to
    ``sq``."""
    if not tab.att:
        return tab.graph[k]
    b = tab.ladder[k]
    return with_squares(tab.graph[k], tab.att, b, sq + item_term(b - t, 1, tab.power), tab.power)


def _choose(tab: _PathTable, t: int, items: int, sq: float) -> tuple[int | None, float]:
    """One path of one batch (tokens fit the ladder): (budget or None for eager-by-cost, cost)."""
    if t == 0:
        return 0, 0.0
    k = bisect_left(tab.ladder, t)
    g = _graph(tab, k, t, sq)
    e = tab.eager.cost(t, items)  # EagerCost.cost_array in _best_runs: the same sums in the same order
    return (None, e) if _eager_wins(e, g) else (tab.ladder[k], g)


def _lone(
    i: int, v: Sequence[int], f: int, paths: tuple[str, ...], tables: list[_PathTable], frames_over: bool
) -> tuple[Batch, float]:
    """Item ``i`` alone (over some path's largest budget, or over the frame limit) and its cost."""
    budgets: dict[str, int | None] = {}
    padded: dict[str, int] = {}
    eager: dict[str, EagerReason] = {}
    total = 0.0
    for path, tab, t in zip(paths, tables, v):
        padded[path] = 0
        if not t:
            budgets[path] = 0
            continue
        e = tab.eager.cost(t, 1)
        if frames_over or t > tab.ladder[-1]:
            budgets[path] = None
            eager[path] = _FRAMES if frames_over else _TOKENS
            total += e
            continue
        k = bisect_left(tab.ladder, t)
        g = _graph(tab, k, t, item_term(t, f, tab.power))
        if _eager_wins(e, g):
            budgets[path] = None
            eager[path] = _COST
            total += e
        else:
            b = budgets[path] = tab.ladder[k]
            padded[path] = b - t
            total += g
    return _fast_batch((i,), budgets, dict(zip(paths, v)), padded, f, eager), total


def cost_batches(
    values: Sequence[Sequence[int]],
    frames: Sequence[int],
    totals: Sequence[int],
    paths: tuple[str, ...],
    ladders: list[tuple[int, ...]],
    n_max: int,
    f_cap: int,
    costs: CostModel,
    *,
    build: bool = True,
) -> tuple[list[Batch], float]:
    """The least-cost batches (see the module docs) and their total expected cost (ms).

    ``values[i]`` are item ``i``'s tokens in ``paths`` order; inputs are validated by the caller.  With
    ``build=False`` only the cost is computed (the batches list is empty): the ladder tuner's inner loop.
    """
    caps = [lad[-1] for lad in ladders]
    tables = [_table(costs, path, lad) for path, lad in zip(paths, ladders)]
    order = sorted(range(len(totals)), key=totals.__getitem__)
    lone_out: list[tuple[int, Batch]] = []
    total = 0.0
    # Which items sit alone, checked per path in bulk: over this path's largest budget, or too many frames.
    over = [f > f_cap for f in frames] if max(frames, default=0) > f_cap else None
    for col, cap in zip(zip(*values), caps):
        if max(col) > cap:
            over = [a > cap for a in col] if over is None else [o or a > cap for o, a in zip(over, col)]
    if over is None:
        keep = order  # the common case: nothing sits alone
    else:
        keep = []
        for pos, i in enumerate(order):
            if over[i]:
                f = frames[i]
                batch, c = _lone(i, values[i], f, paths, tables, f > f_cap)
                total += c
                lone_out.append((pos, batch))
            else:
                keep.append(i)
    m = len(keep)
    if not m:
        return [b for _, b in lone_out] if build else [], total
    squared = any(tab.att for tab in tables)
    if m == 1:
        # One item (most requests): no split to choose, skip numpy.
        f1 = frames[keep[0]]
        terms = [item_term(t, f1, tab.power) for tab, t in zip(tables, values[keep[0]])]
        total += sum(_choose(tab, t, 1, sq)[1] for tab, t, sq in zip(tables, values[keep[0]], terms))
        runs = [(0, 1)]
        cum = [[0] * len(paths), list(values[keep[0]])]
        cum_sq = [[0.0] * len(paths), terms] if squared else None
    else:
        c, runs, cum, cum_sq = _best_runs(values, frames, keep, tables, caps, n_max, f_cap, squared)
        total += c
    if not build:
        return [], total
    out: list[tuple[int, Batch]] = []
    if lone_out:
        pos_of = {i: pos for pos, i in enumerate(order)}
    cum_f = list(accumulate([frames[i] for i in keep], initial=0))
    for lo, hi in runs:
        n_run = hi - lo
        budgets: dict[str, int | None] = {}
        tokens: dict[str, int] = {}
        padded: dict[str, int] = {}
        eager: dict[str, EagerReason] = {}
        # _choose inlined (this loop runs once per batch and path).
        for p, (path, tab, t_lo, t_hi) in enumerate(zip(paths, tables, cum[lo], cum[hi])):
            t = tokens[path] = t_hi - t_lo
            if t == 0:
                budgets[path] = padded[path] = 0
                continue
            k = bisect_left(tab.ladder, t)
            g = tab.graph[k] if cum_sq is None else _graph(tab, k, t, cum_sq[hi][p] - cum_sq[lo][p])
            if _eager_wins(tab.eager.cost(t, n_run), g):
                budgets[path] = None
                eager[path] = _COST
                padded[path] = 0
            else:
                b = budgets[path] = tab.ladder[k]
                padded[path] = b - t
        members = tuple(keep[lo:hi])
        batch = _fast_batch(members, budgets, tokens, padded, cum_f[hi] - cum_f[lo], eager)
        out.append((pos_of[members[0]] if lone_out else 0, batch))
    if lone_out:
        out.extend(lone_out)
        out.sort(key=lambda pb: pb[0])
    return [b for _, b in out], total


def _best_runs(
    values: Sequence[Sequence[int]],
    frames: Sequence[int],
    keep: list[int],
    tables: list[_PathTable],
    caps: list[int],
    n_max: int,
    f_cap: int,
    squared: bool = False,
) -> tuple[float, list[tuple[int, int]], list[list[int]], list[list[float]] | None]:
    """Least total cost of splitting ``keep`` (sorted, none lone) into runs, the runs ``(lo, hi)``, the
    cumulative tokens per path (``cum[j][p]``: path ``p``'s tokens of the first ``j`` kept items) and, with
    ``squared``, the cumulative item terms likewise (:func:`item_term`: ``tokens^2 / frames`` at power 2; else
    ``None``)."""
    m = len(keep)
    n_paths = len(tables)
    vals = np.array([values[i] for i in keep], dtype=np.int64).reshape(m, n_paths)
    cum = np.zeros((m + 1, n_paths), dtype=np.int64)
    np.cumsum(vals, axis=0, out=cum[1:])
    cum_sq = None
    if squared:
        fr_all = np.array([frames[i] for i in keep], dtype=np.float64)[:, None]
        cum_sq = np.zeros((m + 1, n_paths), dtype=np.float64)
        powers = np.array([tab.power for tab in tables], dtype=np.float64)[None, :]
        # frames * (tokens / frames) ** power, per path's power
        np.cumsum(vals.astype(np.float64) ** powers / fr_all ** (powers - 1.0), axis=0, out=cum_sq[1:])
    # The longest run that can fit: bounded by the k smallest items on every path and in frames.
    span = min(n_max, m)
    for p in range(n_paths):
        span = min(span, int(np.searchsorted(np.cumsum(np.sort(vals[:, p])), caps[p], side="right")))
    fr = [frames[i] for i in keep]
    limit_frames = f_cap < m * max(fr)
    if limit_frames:
        fr_np = np.array(fr, dtype=np.int64)
        span = min(span, int(np.searchsorted(np.cumsum(np.sort(fr_np)), f_cap, side="right")))
    span = max(span, 1)
    ends = np.arange(1, m + 1)[:, None]
    lens = np.arange(1, span + 1)[None, :]
    starts = ends - lens
    ok = starts >= 0
    np.maximum(starts, 0, out=starts)
    tok = cum[ends] - cum[starts]  # (m, span, paths): tokens of the run of lens items ending before ends
    if limit_frames:
        cumf = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(fr_np, out=cumf[1:])
        ok &= (cumf[ends] - cumf[starts]) <= f_cap
    cost = None
    for p, tab in enumerate(tables):
        t = tok[:, :, p]
        ok &= t <= caps[p]
        idx = np.searchsorted(tab.ladder_np, t)
        np.minimum(idx, len(tab.ladder) - 1, out=idx)
        c = tab.eager.cost_array(t, lens)  # eager
        if tab.att:  # with_squares, elementwise: the run's items' squares plus the padding's
            b = tab.ladder_np[idx]
            b2 = tab.ladder_sq_np[idx]
            sq = (cum_sq[ends, p] - cum_sq[starts, p]) + np.maximum(b - t, 0).astype(np.float64) ** tab.power  # b < t: past the cap, masked
            g = np.maximum(tab.graph_np[idx] - tab.att * (b2 - np.clip(sq, 0.0, b2)), 0.0)
        else:
            g = tab.graph_np[idx]
        c = np.where(_eager_wins(c, g), c, g)
        c[t == 0] = 0.0
        if cost is None:
            cost = c
        else:
            cost += c
    # Every limit only tightens as a run grows, so the feasible lengths of each row are a prefix 1..width.
    widths = ok.sum(axis=1).tolist()
    rows = cost.tolist()  # rows[j - 1][k - 1]: the run of k items ending before j
    # dpp[s + 1] is the least cost of the first s items; dpp[j : j - w : -1] are dp[j - 1], ..., dp[j - w], lined
    # up with rows[j - 1] (map stops at the shorter, so lengths past the width are never read).
    dpp = [0.0, 0.0]
    append = dpp.append
    for j in range(1, m + 1):
        append(min(map(add, dpp[j : j - widths[j - 1] : -1], rows[j - 1])))
    # Walk back: the shortest last run that reaches the optimum (the same sums as above, so == is exact).
    runs = []
    j = m
    while j:
        row = rows[j - 1]
        best = dpp[j + 1]
        k = 1
        while dpp[j - k + 1] + row[k - 1] != best:
            k += 1
        runs.append((j - k, j))
        j -= k
    runs.reverse()
    return dpp[m + 1], runs, cum.tolist(), (cum_sq.tolist() if cum_sq is not None else None)
