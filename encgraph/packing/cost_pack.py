"""The cost-aware planner: the batch split and graph-vs-eager choice of least expected time.

:func:`encgraph.packing.pack` delegates here when given ``costs=`` (a :class:`CostModel`).  Pure (numpy, no torch).

Algorithm (deterministic, ``O(n * L)`` for ``n`` items and runs of at most ``L`` items):

1. Items are sorted ascending by total tokens, ties in input order (the greedy planner's order).  An item over
   some path's largest budget, or with more frames than ``max_frames``, sits alone as in the greedy planner.
2. The other items keep that order; every contiguous run of them that fits ``max_items``, ``max_frames`` and
   every path's largest budget is a candidate batch.  Its cost is, per path, the cheaper of the graph of the
   smallest budget that holds its tokens and an eager run (:attr:`EagerReason.COST` when eager is strictly
   cheaper); 0 on a path with no tokens.  The costs of all runs are computed at once with numpy.
3. Dynamic programming over run ends picks the split of least total cost (ties: the shorter last run).
   Greedy's batches are such runs, so the result never costs more than the greedy plan under the same model.
4. Batches come out in the sorted order of their first item, lone items in place.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from operator import add

import numpy as np

from encgraph._validate import describe
from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing.costs import CostModel
from encgraph.packing.plan import Batch, EagerReason, _fast_batch

__all__ = ["check_costs", "cost_batches"]

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


def _choose(costs: CostModel, path: str, ladder: tuple[int, ...], t: int, items: int) -> tuple[int | None, float]:
    """One path of one batch (tokens fit the ladder): (budget or None for eager-by-cost, cost)."""
    if t == 0:
        return 0, 0.0
    k = bisect_left(ladder, t)
    g = costs._ladder_costs(path, ladder)[k]
    e = costs.eager[path].cost(t, items)
    return (None, e) if e < g else (ladder[k], g)


def _lone(
    i: int, v: Sequence[int], f: int, paths: tuple[str, ...], ladders: list[tuple[int, ...]], frames_over: bool,
    costs: CostModel,
) -> tuple[Batch, float]:
    budgets: dict[str, int | None] = {}
    padded: dict[str, int] = {}
    eager: dict[str, EagerReason] = {}
    total = 0.0
    for path, ladder, t in zip(paths, ladders, v):
        padded[path] = 0
        if t and (frames_over or t > ladder[-1]):
            budgets[path] = None
            eager[path] = _FRAMES if frames_over else _TOKENS
            total += costs.eager[path].cost(t, 1)
            continue
        b, c = _choose(costs, path, ladder, t, 1)
        total += c
        budgets[path] = b
        if b is None:
            eager[path] = _COST
        else:
            padded[path] = b - t
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
    order = sorted(range(len(totals)), key=totals.__getitem__)
    keep: list[int] = []
    lone_out: list[tuple[int, Batch]] = []
    total = 0.0
    if max(frames, default=0) <= f_cap and all(max(col, default=0) <= c for col, c in zip(zip(*values), caps)):
        keep = order  # the common case: nothing sits alone, checked in bulk
    else:
        for pos, i in enumerate(order):
            v = values[i]
            f = frames[i]
            if f > f_cap or any(a > c for a, c in zip(v, caps)):
                batch, c = _lone(i, v, f, paths, ladders, f > f_cap, costs)
                total += c
                lone_out.append((pos, batch))
            else:
                keep.append(i)
    m = len(keep)
    if not m:
        return [b for _, b in lone_out] if build else [], total
    if m == 1:
        # One item (most requests): no split to choose, skip numpy.
        i = keep[0]
        total += sum(_choose(costs, path, lad, t, 1)[1] for path, lad, t in zip(paths, ladders, values[i]))
        runs = [(0, 1)]
    else:
        c, runs = _best_runs(values, frames, keep, paths, ladders, caps, n_max, f_cap, costs)
        total += c
    if not build:
        return [], total
    pos_of = {i: pos for pos, i in enumerate(order)}
    out: list[tuple[int, Batch]] = []
    for lo, hi in runs:
        members = keep[lo:hi]
        toks = [sum(col) for col in zip(*(values[i] for i in members))]
        budgets: dict[str, int | None] = {}
        padded: dict[str, int] = {}
        eager: dict[str, EagerReason] = {}
        for path, ladder, t in zip(paths, ladders, toks):
            b, _ = _choose(costs, path, ladder, t, hi - lo)
            budgets[path] = b
            if b is None:
                eager[path] = _COST
                padded[path] = 0
            else:
                padded[path] = b - t
        fsum = sum(frames[i] for i in members)
        out.append((pos_of[members[0]], _fast_batch(tuple(members), budgets, dict(zip(paths, toks)), padded, fsum, eager)))
    if lone_out:
        out.extend(lone_out)
        out.sort(key=lambda pb: pb[0])
    return [b for _, b in out], total


def _best_runs(
    values: Sequence[Sequence[int]],
    frames: Sequence[int],
    keep: list[int],
    paths: tuple[str, ...],
    ladders: list[tuple[int, ...]],
    caps: list[int],
    n_max: int,
    f_cap: int,
    costs: CostModel,
) -> tuple[float, list[tuple[int, int]]]:
    """Least total cost of splitting ``keep`` (sorted, none lone) into runs, and the runs ``(lo, hi)``."""
    m = len(keep)
    n_paths = len(paths)
    vals = np.array([values[i] for i in keep], dtype=np.int64).reshape(m, n_paths)
    cum = np.zeros((m + 1, n_paths), dtype=np.int64)
    np.cumsum(vals, axis=0, out=cum[1:])
    # The longest run that can fit: bounded by the k smallest items on every path and in frames.
    span = min(n_max, m)
    for p in range(n_paths):
        span = min(span, int(np.searchsorted(np.cumsum(np.sort(vals[:, p])), caps[p], side="right")))
    fr = np.array([frames[i] for i in keep], dtype=np.int64)
    limit_frames = f_cap < m * int(fr.max())
    if limit_frames:
        span = min(span, int(np.searchsorted(np.cumsum(np.sort(fr)), f_cap, side="right")))
    span = max(span, 1)
    ends = np.arange(1, m + 1)[:, None]
    lens = np.arange(1, span + 1)[None, :]
    starts = ends - lens
    ok = starts >= 0
    np.maximum(starts, 0, out=starts)
    tok = cum[ends] - cum[starts]  # (m, span, paths): tokens of the run of lens items ending before ends
    if limit_frames:
        cumf = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(fr, out=cumf[1:])
        ok &= (cumf[ends] - cumf[starts]) <= f_cap
    cost = np.zeros((m, span))
    for p, (path, ladder) in enumerate(zip(paths, ladders)):
        t = tok[:, :, p]
        ok &= t <= caps[p]
        idx = np.searchsorted(np.asarray(ladder), t)
        np.minimum(idx, len(ladder) - 1, out=idx)
        g = np.asarray(costs._ladder_costs(path, ladder))[idx]
        e = costs.eager[path]
        eager_cost = e.fixed_ms + e.per_token_ms * t + e.per_item_ms * lens
        cost += np.where(t == 0, 0.0, np.minimum(g, eager_cost))
    # Every limit only tightens as a run grows, so the feasible lengths of each row are a prefix 1..width.
    widths = ok.sum(axis=1).tolist()
    rows = cost.tolist()
    dp = [0.0] * (m + 1)
    arg = [0] * (m + 1)
    for j in range(1, m + 1):
        prev = dp[j - widths[j - 1] : j]
        prev.reverse()  # prev[k - 1] = dp[j - k]
        sums = list(map(add, prev, rows[j - 1]))
        best = min(sums)
        dp[j] = best
        arg[j] = sums.index(best) + 1
    runs = []
    j = m
    while j:
        runs.append((j - arg[j], j))
        j -= arg[j]
    runs.reverse()
    return dp[m], runs
