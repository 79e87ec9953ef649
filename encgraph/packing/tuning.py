"""Ladder tuning: choose the budgets to capture from the item sizes a runner has seen.

:func:`tune_ladder` takes the requests a runner recorded and returns a :class:`TunedLadder`: at most
``max_budgets`` budgets per path that minimise the expected time of planning those requests with the cost-aware
:func:`~encgraph.packing.pack` under a :class:`~encgraph.packing.CostModel` (measured, or
:func:`default_cost_model`).  Pure (numpy, no torch), deterministic.

**Memory model.**  Each captured budget keeps static input/output buffers and graph-private activations whose
size grows with the budget; graphs share one memory pool, but a conservative bound that needs no measurement is
that memory is proportional to the sum of the captured budgets over all paths.  ``memory_cap_tokens`` bounds that
sum.  When the largest item does not fit under the cap, the top budget is the largest candidate that does and
bigger items run eager (:attr:`~encgraph.packing.EagerReason.TOKENS`).

**Search** (per path, candidates are multiples of ``granularity`` between the bounds):

1. The top budget of each path covers the largest item of the traffic (rounded up to ``granularity``, capped by
   ``max_budget`` and the memory cap); it stays.  The other candidates are the rounded-up sizes of items and of
   whole requests, thinned to at most :data:`MAX_CANDIDATES` evenly spaced by rank.
2. Forward selection: add the candidate (over all paths) that lowers the expected cost most, while any path has
   fewer than ``max_budgets`` budgets and the memory cap holds; stop when nothing helps.
3. Coordinate descent: replace one non-top budget at a time by the candidate that lowers the cost most, until a
   pass changes nothing (at most :data:`MAX_PASSES` passes).
4. The baseline ladder (``baseline``, else ``budget_ladder(max(smallest candidate, 64), top)`` per path) is kept
   instead when it satisfies the constraints and costs strictly less on the whole traffic (the search works on
   a sample, step 5), so the result is never worse than the baseline.

5. Costs during the search are evaluated on the distinct requests, weighted by how often they occur; beyond
   :data:`MAX_GROUPS` distinct requests, on :data:`MAX_GROUPS` representatives (requests sorted by tokens, cut
   into equal strata, each represented by its middle request with the stratum's weight), so the run time is
   bounded (under a second for 1,000 requests).  The reported costs are on the whole traffic.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from encgraph._validate import check_int, check_optional_int, check_sequence, describe
from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing.cost_pack import check_costs, cost_batches
from encgraph.packing.costs import CostModel
from encgraph.packing.ladder import DEFAULT_PATH, budget_ladder, normalize_ladders
from encgraph.packing.limits import check_limits
from encgraph.packing.spec import ItemSpec

__all__ = ["TunedLadder", "tune_ladder", "default_cost_model", "DEFAULT_COSTS"]

#: The default cost model's constants (ms), used when no measured :class:`CostModel` is given: graph replay
#: ``graph_fixed_ms + graph_per_budget_ms * budget``, eager ``eager_fixed_ms + eager_per_token_ms * tokens``.
#: Shaped after the Qwen2.5-VL-7B tower on an H200 (issue 6): eager pays thousands of kernel launches (a large
#: fixed cost), a graph pays for every padded token, and at a few thousand tokens the two meet.
DEFAULT_COSTS = {
    "graph_fixed_ms": 0.5,
    "graph_per_budget_ms": 0.004,
    "eager_fixed_ms": 8.0,
    "eager_per_token_ms": 0.0045,
}

#: Search bounds (see the module docs).
MAX_CANDIDATES = 16
MAX_GROUPS = 64
MAX_PASSES = 3


def default_cost_model(paths: Sequence[str] | Mapping[str, Any]) -> CostModel:
    """The linear :data:`DEFAULT_COSTS` model on every one of ``paths`` (a mapping: its keys)."""
    return CostModel.linear(list(paths), **DEFAULT_COSTS)


@attrs.frozen
class TunedLadder:
    """The result of :func:`tune_ladder`.

    Attributes:
        ladders: ``{path: ladder}`` chosen (``0`` first on a path where some observed item has no tokens).
        baseline: ``{path: ladder}`` compared against.
        cost_before_ms, cost_after_ms: expected time (ms) of the observed traffic with the baseline and the
            tuned ladders, under the same model.
        padded_share_before, padded_share_after: padding / (real + padding) tokens over all paths.
        max_items, max_frames: the limits the traffic was planned with (pass them to the runner too).
    """

    ladders: dict[str, tuple[int, ...]]
    baseline: dict[str, tuple[int, ...]]
    cost_before_ms: float
    cost_after_ms: float
    padded_share_before: float
    padded_share_after: float
    max_items: int
    max_frames: int | None

    __hash__ = None  # type: ignore[assignment]  # holds dicts

    def to_runner_options(self) -> dict[str, Any]:
        """Keyword arguments for ``EncoderGraphRunner(adapter, **options)``: ``budgets`` (a bare ladder for a
        one-path encoder), ``max_items`` and, when set, ``max_frames``."""
        budgets: Any = dict(self.ladders)
        if list(budgets) == [DEFAULT_PATH]:
            budgets = budgets[DEFAULT_PATH]
        out: dict[str, Any] = {"budgets": budgets, "max_items": self.max_items}
        if self.max_frames is not None:
            out["max_frames"] = self.max_frames
        return out


def _requests(observed: Any) -> list[list[ItemSpec]]:
    check_sequence("tune_ladder(observed)", observed, hint="Pass the recorded requests: a list of lists of ItemSpec.")
    out = []
    for r, request in enumerate(observed):
        check_sequence(f"tune_ladder(observed[{r}])", request, hint="A request is a list of ItemSpec or token counts.")
        items = []
        for i, item in enumerate(request):
            if isinstance(item, ItemSpec):
                items.append(item)
            elif isinstance(item, int) and not isinstance(item, bool):
                items.append(ItemSpec(check_int(f"tune_ladder(observed[{r}][{i}])", item, minimum=1)))
            else:
                raise ConfigTypeError(
                    f"tune_ladder(observed[{r}][{i}]): expected an ItemSpec or an int token count, got {describe(item)}."
                )
        if items:
            out.append(items)
    if not out:
        raise ConfigError("tune_ladder(observed): expected at least one non-empty request, got none. Record traffic first.")
    paths = {it.paths for req in out for it in req}
    if len(paths) != 1:
        raise ConfigError(
            f"tune_ladder(observed): expected every item on the same paths, got {sorted(paths)}. Give every item a "
            f"token count (0 if none) on each path of the encoder."
        )
    return out


def _round_up(x: int, g: int) -> int:
    return max(g, -(-x // g) * g)


def _thin(values: list[int], k: int) -> list[int]:
    if len(values) <= k:
        return values
    return sorted({values[round(j * (len(values) - 1) / (k - 1))] for j in range(k)})


class _Traffic:
    """The observed requests as plain tuples, grouped, with an evaluator of a ladder's expected cost."""

    def __init__(self, requests: list[list[ItemSpec]], n_max: int, f_cap: int, costs: CostModel) -> None:
        self.paths = requests[0][0].paths
        groups = Counter(tuple((it._values, it.frames) for it in req) for req in requests)
        self.groups = sorted(groups.items(), key=lambda kv: (sum(sum(v) for v, _ in kv[0]), kv[0]))
        self.n_max, self.f_cap, self.costs = n_max, f_cap, costs
        self.sample = self.groups
        if len(self.groups) > MAX_GROUPS:
            self.sample = []
            n = len(self.groups)
            for s in range(MAX_GROUPS):
                lo, hi = s * n // MAX_GROUPS, (s + 1) * n // MAX_GROUPS
                weight = sum(w for _, w in self.groups[lo:hi])
                self.sample.append((self.groups[(lo + hi) // 2][0], weight))
        self._memo: dict[tuple[tuple[int, ...], ...], float] = {}

    def _run(self, group: tuple, ladders: list[tuple[int, ...]], build: bool) -> tuple[list, float]:
        values = [v for v, _ in group]
        frames = [f for _, f in group]
        return cost_batches(
            values, frames, [sum(v) for v in values], self.paths, ladders, self.n_max, self.f_cap, self.costs,
            build=build,
        )

    def cost(self, ladders: list[tuple[int, ...]]) -> float:
        key = tuple(ladders)
        if key not in self._memo:
            self._memo[key] = sum(w * self._run(g, ladders, False)[1] for g, w in self.sample)
        return self._memo[key]

    def full(self, ladders: list[tuple[int, ...]]) -> tuple[float, float]:
        """(expected cost, padded share) on the whole traffic."""
        total = real = pad = 0.0
        for g, w in self.groups:
            batches, c = self._run(g, ladders, True)
            total += w * c
            for b in batches:
                real += w * sum(b.tokens.values())
                pad += w * sum(b.padded.values())
        return total, (pad / (real + pad) if real + pad else 0.0)


def tune_ladder(
    observed: Sequence[Sequence[ItemSpec | int]],
    *,
    max_budgets: int,
    max_items: int,
    max_frames: int | None = None,
    min_budget: int | None = None,
    max_budget: int | None = None,
    memory_cap_tokens: int | None = None,
    costs: CostModel | None = None,
    granularity: int = 64,
    baseline: Any = None,
) -> TunedLadder:
    """Choose at most ``max_budgets`` budgets per path minimising the expected cost of ``observed``.

    Args:
        observed: the recorded requests, each a sequence of :class:`ItemSpec` (or of int token counts, on the
            path ``"default"``); each request is planned on its own, as the runner does.
        max_budgets: most budgets per path, >= 1.
        max_items, max_frames: the per-batch limits the runner plans with.  Budgets are at least ``max_items``
            (capture needs a token per item).
        min_budget, max_budget: bounds on the budgets (``max_budget`` caps the top budget: bigger items go eager).
        memory_cap_tokens: most tokens summed over all budgets of all paths (see the memory model above).
        costs: a measured :class:`CostModel`, or ``None`` for :func:`default_cost_model`.
        granularity: budgets are multiples of it, >= 1.
        baseline: the ladder(s) to compare against (one ladder or ``{path: ladder}``, e.g. the runner's
            current budgets); default ``budget_ladder(max(smallest candidate, 64), top)`` per path.

    >>> tuned = tune_ladder([[300]] * 50, max_budgets=2, max_items=1)
    >>> tuned.ladders, tuned.cost_after_ms <= tuned.cost_before_ms
    ({'default': (320,)}, True)
    >>> tuned.to_runner_options()
    {'budgets': (320,), 'max_items': 1}

    Raises:
        ConfigTypeError / ConfigError: a bad argument (named in the message), or no budget fits the bounds.
    """
    requests = _requests(observed)
    n_budgets = check_int("tune_ladder(max_budgets)", max_budgets, minimum=1, hint="Capture at least one budget.")
    n_max, f_max = check_limits(None, max_items, max_frames, where="tune_ladder")
    gran = check_int("tune_ladder(granularity)", granularity, minimum=1, hint="Use 1 for any budget, 64 to align.")
    lo_b = check_optional_int("tune_ladder(min_budget)", min_budget, minimum=1)
    hi_b = check_optional_int("tune_ladder(max_budget)", max_budget, minimum=1)
    cap = check_optional_int("tune_ladder(memory_cap_tokens)", memory_cap_tokens, minimum=1)
    paths = requests[0][0].paths
    model = default_cost_model(paths) if costs is None else check_costs(costs, paths, where="tune_ladder")
    f_cap = f_max if f_max is not None else n_max * max(it.frames for req in requests for it in req)
    traffic = _Traffic(requests, n_max, f_cap, model)

    floor = _round_up(max(lo_b or 1, n_max), gran)
    ceiling = hi_b // gran * gran if hi_b is not None else None
    if ceiling is not None and ceiling < floor:
        raise ConfigError(
            f"tune_ladder(max_budget): expected room for a multiple of granularity={gran} >= {floor} (max_items and "
            f"min_budget), got max_budget={hi_b}. Raise max_budget or lower granularity/min_budget/max_items."
        )
    if cap is not None and cap < floor * len(paths):
        raise ConfigError(
            f"tune_ladder(memory_cap_tokens): expected at least {floor * len(paths)} (one smallest budget per path), "
            f"got {cap}. Raise the cap or lower min_budget/max_items/granularity."
        )
    cands: list[list[int]] = []
    tops: list[int] = []
    for p in range(len(paths)):
        sizes = [it._values[p] for req in requests for it in req]
        sizes += [sum(it._values[p] for it in req) for req in requests]
        top = _round_up(max(max(sizes[: len(sizes) - len(requests)]), 1), gran)
        top = max(floor, top if ceiling is None else min(top, ceiling))
        vals = sorted({min(max(floor, _round_up(s, gran)), top) for s in sizes if s})
        cands.append(_thin(vals, MAX_CANDIDATES))
        tops.append(top)
    # The memory cap binds the tops first: shrink the largest top to the next smaller candidate until they fit.
    while cap is not None and sum(tops) > cap:
        p = max(range(len(paths)), key=lambda q: (tops[q], -q))
        smaller = [c for c in cands[p] if c < tops[p]]
        tops[p] = smaller[-1] if smaller else floor
    cands = [[c for c in cs if c <= t] for cs, t in zip(cands, tops)]

    def fits(lads: list[tuple[int, ...]]) -> bool:
        return all(len(lad) <= n_budgets for lad in lads) and (cap is None or sum(map(sum, lads)) <= cap)

    current = [(t,) for t in tops]
    best = traffic.cost(current)
    while True:  # forward selection
        move = None
        for p, cs in enumerate(cands):
            for c in cs:
                if c in current[p]:
                    continue
                trial = current[:p] + [tuple(sorted(current[p] + (c,)))] + current[p + 1 :]
                if fits(trial):
                    cost = traffic.cost(trial)
                    if cost < best * (1 - 1e-12) and (move is None or cost < move[0]):
                        move = (cost, trial)
        if move is None:
            break
        best, current = move
    for _ in range(MAX_PASSES):  # coordinate descent over the non-top budgets
        changed = False
        for p, cs in enumerate(cands):
            for k in range(len(current[p]) - 1):
                move = None
                for c in cs:
                    if c in current[p] or c >= tops[p]:
                        continue
                    lad = tuple(sorted(current[p][:k] + (c,) + current[p][k + 1 :]))
                    trial = current[:p] + [lad] + current[p + 1 :]
                    if fits(trial):
                        cost = traffic.cost(trial)
                        if cost < best * (1 - 1e-12) and (move is None or cost < move[0]):
                            move = (cost, trial)
                if move is not None:
                    best, current = move
                    changed = True
        if not changed:
            break

    if baseline is None:
        base = [budget_ladder(min(max(floor, 64), t), t) for t in tops]
    else:
        norm = normalize_ladders(baseline, paths=paths)
        base = [tuple(b for b in norm[p] if b) for p in paths]
    before, share_before = traffic.full(base)
    after, share_after = traffic.full(current)
    base_ok = fits(base) and all(min(lad) >= n_max for lad in base)
    if base_ok and before < after:
        current, after, share_after = base, before, share_before
    has_zero = [any(it._values[p] == 0 for req in requests for it in req) for p in range(len(paths))]
    return TunedLadder(
        ladders={p: ((0,) if z else ()) + lad for p, lad, z in zip(paths, current, has_zero)},
        baseline={p: ((0,) if z else ()) + lad for p, lad, z in zip(paths, base, has_zero)},
        cost_before_ms=before,
        cost_after_ms=after,
        padded_share_before=share_before,
        padded_share_after=share_after,
        max_items=n_max,
        max_frames=f_max,
    )
