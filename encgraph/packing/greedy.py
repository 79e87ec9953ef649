"""The greedy planner: split items into batches that fit the captured budgets."""

from __future__ import annotations

import sys
import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from encgraph._validate import check_sequence, describe
from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing.cost_pack import check_costs, cost_batches
from encgraph.packing.costs import CostModel
from encgraph.packing.ladder import normalize_ladders
from encgraph.packing.limits import _fast_limits, check_limits
from encgraph.packing.plan import Batch, EagerReason, Plan, _fast_batch, _fast_plan
from encgraph.packing.spec import ItemSpec

__all__ = ["pack"]

_TOKENS = EagerReason.TOKENS
_FRAMES = EagerReason.FRAMES
_NO_LIMIT = sys.maxsize


def pack(
    items: Sequence[ItemSpec],
    ladders: Iterable[int] | Mapping[str, Iterable[int]],
    *,
    max_items: int,
    max_frames: int | None = None,
    costs: CostModel | None = None,
) -> Plan:
    """Split ``items`` into batches, each replayed through one captured budget per path (or run eager).

    The algorithm (greedy, deterministic, ``O(n log n)``):

    1. Items are sorted ascending by total tokens; ties keep the input order.
    2. Next-fit: an item joins the open batch unless that would put some path over its largest budget, or the
       batch over ``max_items`` items or ``max_frames`` frames; then the open batch closes and a new one opens.
       An item that alone is over the largest budget of some path, or has more frames than ``max_frames``,
       sits alone in its own batch.
    3. When a batch closes, each path independently gets the smallest budget >= its tokens; ``0`` where the
       batch has no tokens on that path (skip it); ``None`` with :attr:`EagerReason.TOKENS` where no budget
       holds them.  Only the overflowing path goes eager: the other paths of that batch still replay (partial
       eager).  A lone item with more frames than ``max_frames`` is eager on every path where it has tokens,
       with :attr:`EagerReason.FRAMES` (its metadata cannot fit the captured buffers).

    Args:
        items: the item specs; every item must name exactly the ladders' paths (an ``int``-token
            :class:`ItemSpec` is on the path ``"default"``).
        ladders: one ladder (path ``"default"``) or ``{path: ladder}``; see :func:`normalize_ladders`.
        max_items: most items per batch, >= 1.  The planner does not tie it to the budgets; the capture side
            does (see :func:`default_limits`).
        max_frames: most frames per batch (>= ``max_items``), or ``None`` for no frame limit.
        costs: a :class:`CostModel` to plan for least expected time instead (dynamic programming over runs
            of the sorted items, graph or eager per batch per path; see :mod:`encgraph.packing.cost_pack`),
            or ``None`` (the default) for the greedy plan above.

    Returns:
        A :class:`Plan`; no items give a plan with no batches.

    >>> plan = pack([ItemSpec(2049)], (2048, 4096, 8192), max_items=4)
    >>> plan.batches[0].budgets, plan.batches[0].padded
    ({'default': 4096}, {'default': 2047})
    >>> pack([ItemSpec(9000)], (2048, 4096, 8192), max_items=4).batches[0].eager
    {'default': <EagerReason.TOKENS: 'tokens over the largest budget'>}

    Raises:
        ConfigTypeError: ``items`` is not a sequence of :class:`ItemSpec`, or a ladder or limit has a bad type.
        ConfigError: an item names an unknown path or misses one, or a ladder or limit has a bad value.
    """
    lad = normalize_ladders(ladders)
    n_max, f_max = check_limits(None, max_items, max_frames)
    check_sequence("pack(items)", items, hint="Pass a list of ItemSpec.")
    paths = tuple(lad)
    n = len(items)

    key = tuple(sorted(paths))
    # Items were validated when built; here only their type and paths are checked, in bulk.
    if set(map(type, items)) - {ItemSpec} and not all(isinstance(it, ItemSpec) for it in items):
        _raise_bad_item(items, paths)
    if not ({it._paths for it in items} <= {key}):
        _raise_bad_item(items, paths)

    frames = [it.frames for it in items]
    limits = _fast_limits(n_max, f_max if f_max is not None else n_max * max(frames, default=1))
    f_cap = _NO_LIMIT if f_max is None else f_max
    if costs is not None:
        return _fast_plan(tuple(_pack_costed(items, frames, paths, key, lad, n_max, f_cap, costs)), n, paths, lad, limits)
    if len(paths) == 1:
        batches = _pack_one(items, frames, paths[0], lad[paths[0]], n_max, f_cap)
    elif len(paths) == 2:
        batches = _pack_two(items, frames, paths, key, lad, n_max, f_cap)
    else:
        batches = _pack_many(items, frames, paths, key, lad, n_max, f_cap)
    return _fast_plan(tuple(batches), n, paths, lad, limits)


def _pack_costed(
    items: Sequence[ItemSpec],
    frames: list[int],
    paths: tuple[str, ...],
    key: tuple[str, ...],
    lad: dict[str, tuple[int, ...]],
    n_max: int,
    f_cap: int,
    costs: CostModel,
) -> list[Batch]:
    check_costs(costs, paths)
    values = [it._values for it in items]
    if key != paths:
        perm = [key.index(p) for p in paths]
        values = [tuple(v[j] for j in perm) for v in values]
    ladders = tuple(lad[p] for p in paths)
    memo_key = (id(costs), tuple(values), tuple(frames), paths, ladders, n_max, f_cap)
    found = _COSTED.get(memo_key, costs)
    if found is not None:
        return found
    totals = [it._total for it in items]
    batches, _ = cost_batches(values, frames, totals, paths, list(ladders), n_max, f_cap, costs)
    _COSTED.put(memo_key, costs, batches)
    return batches


class _CostedPlans:
    """The last :data:`COSTED_PLANS` least-cost plans, by their items, ladders, limits and cost model.

    A serving runner sees the same calls again and again (a batch ladder's calls differ only in their item
    count), and the least-cost plan of a call costs 50-120 us to compute (32 items, a 16-budget ladder, one CPU
    core) where a lookup costs about 2. An entry holds its cost model, and answers only for that very object: a
    corrected model (a new object) plans afresh. Batches are immutable, so plans share them. Thread-safe."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._plans: OrderedDict[tuple[object, ...], tuple[CostModel, list[Batch]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[object, ...], costs: CostModel) -> list[Batch] | None:
        with self._lock:
            entry = self._plans.get(key)
            if entry is None or entry[0] is not costs:
                return None
            self._plans.move_to_end(key)
            return list(entry[1])

    def put(self, key: tuple[object, ...], costs: CostModel, batches: list[Batch]) -> None:
        with self._lock:
            self._plans[key] = (costs, list(batches))
            self._plans.move_to_end(key)
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()


COSTED_PLANS = 512
"""How many least-cost plans :func:`pack` keeps (:class:`_CostedPlans`)."""
_COSTED = _CostedPlans(COSTED_PLANS)


def _raise_bad_item(items: Sequence[object], paths: tuple[str, ...]) -> None:
    want = set(paths)
    for i, it in enumerate(items):
        if not isinstance(it, ItemSpec):
            raise ConfigTypeError(
                f"pack(items[{i}]): expected an ItemSpec, got {describe(it)}. Describe each item with "
                f"ItemSpec(tokens, frames=..., input_size=...)."
            )
        have = set(it.paths)
        if have != want:
            unknown = sorted(have - want)
            if unknown:
                raise ConfigError(
                    f"pack(items[{i}]): unknown path {unknown[0]!r}; expected exactly the ladders' paths "
                    f"{list(paths)}, got {list(it.paths)}. Give the item tokens on exactly these paths, or add a "
                    f"ladder for {unknown[0]!r}."
                )
            missing = sorted(want - have)
            raise ConfigError(
                f"pack(items[{i}]): missing path {missing[0]!r}; expected exactly the ladders' paths {list(paths)}, "
                f"got {list(it.paths)}. Give the item a token count (0 if none) on {missing[0]!r}."
            )
    raise AssertionError("unreachable")  # pragma: no cover


def _pack_one(
    items: Sequence[ItemSpec], frames: list[int], path: str, ladder: tuple[int, ...], n_max: int, f_cap: int
) -> list[Batch]:
    # One path: every item has >= 1 token here, so no batch is ever empty on it.
    totals = [it._total for it in items]
    cap = ladder[-1]
    out: list[Batch] = []
    append = out.append
    cur: list[int] = []
    c_tok = 0
    c_fr = 0
    for i in sorted(range(len(totals)), key=totals.__getitem__):
        t = totals[i]
        f = frames[i]
        if t > cap or f > f_cap:
            if cur:
                b = ladder[bisect_left(ladder, c_tok)]
                append(_fast_batch(tuple(cur), {path: b}, {path: c_tok}, {path: b - c_tok}, c_fr, {}))
                cur = []
                c_tok = c_fr = 0
            reason = _FRAMES if f > f_cap else _TOKENS
            append(_fast_batch((i,), {path: None}, {path: t}, {path: 0}, f, {path: reason}))
            continue
        if cur and (len(cur) >= n_max or c_tok + t > cap or c_fr + f > f_cap):
            b = ladder[bisect_left(ladder, c_tok)]
            append(_fast_batch(tuple(cur), {path: b}, {path: c_tok}, {path: b - c_tok}, c_fr, {}))
            cur = [i]
            c_tok = t
            c_fr = f
        else:
            cur.append(i)
            c_tok += t
            c_fr += f
    if cur:
        b = ladder[bisect_left(ladder, c_tok)]
        append(_fast_batch(tuple(cur), {path: b}, {path: c_tok}, {path: b - c_tok}, c_fr, {}))
    return out


def _close_many(
    members: list[int], toks: list[int], fr: int, paths: tuple[str, ...], ladders: list[tuple[int, ...]],
    frames_over: bool,
) -> Batch:
    budgets: dict[str, int | None] = {}
    padded: dict[str, int] = {}
    eager: dict[str, EagerReason] = {}
    for path, ladder, t in zip(paths, ladders, toks):
        if t == 0:
            budgets[path] = 0
            padded[path] = 0
        elif frames_over:
            budgets[path] = None
            padded[path] = 0
            eager[path] = _FRAMES
        elif t > ladder[-1]:
            budgets[path] = None
            padded[path] = 0
            eager[path] = _TOKENS
        else:
            b = ladder[bisect_left(ladder, t)]
            budgets[path] = b
            padded[path] = b - t
    return _fast_batch(tuple(members), budgets, dict(zip(paths, toks)), padded, fr, eager)


def _pack_two(
    items: Sequence[ItemSpec],
    frames: list[int],
    paths: tuple[str, ...],
    key: tuple[str, ...],
    lad: dict[str, tuple[int, ...]],
    n_max: int,
    f_cap: int,
) -> list[Batch]:
    # _pack_many specialised to two paths (a global and a tile tower): same decisions, scalars instead of
    # per-path lists, about twice as fast.
    values = [it._values for it in items]
    if key != paths:
        values = [(v[1], v[0]) for v in values]
    totals = [it._total for it in items]
    p0, p1 = paths
    l0, l1 = ladders = [lad[p0], lad[p1]]
    c0, c1 = l0[-1], l1[-1]
    out: list[Batch] = []
    append = out.append

    def close(members: list[int], t0: int, t1: int, fr: int) -> Batch:
        b0 = l0[bisect_left(l0, t0)] if t0 else 0
        b1 = l1[bisect_left(l1, t1)] if t1 else 0
        return _fast_batch(tuple(members), {p0: b0, p1: b1}, {p0: t0, p1: t1}, {p0: b0 - t0, p1: b1 - t1}, fr, {})

    cur: list[int] = []
    t0 = t1 = c_fr = 0
    for i in sorted(range(len(totals)), key=totals.__getitem__):
        a0, a1 = values[i]
        f = frames[i]
        if a0 > c0 or a1 > c1 or f > f_cap:
            if cur:
                append(close(cur, t0, t1, c_fr))
                cur = []
                t0 = t1 = c_fr = 0
            append(_close_many([i], [a0, a1], f, paths, ladders, f > f_cap))
            continue
        if cur and (len(cur) >= n_max or t0 + a0 > c0 or t1 + a1 > c1 or c_fr + f > f_cap):
            append(close(cur, t0, t1, c_fr))
            cur = [i]
            t0 = a0
            t1 = a1
            c_fr = f
        else:
            cur.append(i)
            t0 += a0
            t1 += a1
            c_fr += f
    if cur:
        append(close(cur, t0, t1, c_fr))
    return out


def _pack_many(
    items: Sequence[ItemSpec],
    frames: list[int],
    paths: tuple[str, ...],
    key: tuple[str, ...],
    lad: dict[str, tuple[int, ...]],
    n_max: int,
    f_cap: int,
) -> list[Batch]:
    values = [it._values for it in items]
    if key != paths:
        # ItemSpec keeps its paths sorted; reorder its counts to the ladders' path order.
        perm = [key.index(p) for p in paths]
        values = [tuple(v[j] for j in perm) for v in values]
    totals = [it._total for it in items]
    ladders = [lad[p] for p in paths]
    caps = [ladder[-1] for ladder in ladders]
    out: list[Batch] = []
    append = out.append
    cur: list[int] = []
    c_tok = [0] * len(paths)
    c_fr = 0
    for i in sorted(range(len(totals)), key=totals.__getitem__):
        v = values[i]
        f = frames[i]
        lone = f > f_cap
        if not lone:
            for a, c in zip(v, caps):
                if a > c:
                    lone = True
                    break
        if lone:
            if cur:
                append(_close_many(cur, c_tok, c_fr, paths, ladders, False))
                cur = []
            append(_close_many([i], list(v), f, paths, ladders, f > f_cap))
            continue
        if cur:
            fits = len(cur) < n_max and c_fr + f <= f_cap
            if fits:
                for a, t, c in zip(v, c_tok, caps):
                    if a + t > c:
                        fits = False
                        break
            if not fits:
                append(_close_many(cur, c_tok, c_fr, paths, ladders, False))
                cur = []
        if cur:
            cur.append(i)
            c_tok = [t + a for t, a in zip(c_tok, v)]
            c_fr += f
        else:
            cur = [i]
            c_tok = list(v)
            c_fr = f
    if cur:
        append(_close_many(cur, c_tok, c_fr, paths, ladders, False))
    return out
