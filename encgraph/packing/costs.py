"""Expected cost of a plan: measured graph replay time per budget and a fitted eager cost per path.

A :class:`CostModel` answers "how long will this batch take?" for the cost-aware planner
(:func:`encgraph.packing.pack` with ``costs=``) and the ladder tuner (:func:`encgraph.packing.tune_ladder`).
Times are milliseconds.  Pure Python + numpy (the least-squares fit): importing it never imports torch.

Per path:

- **graph**: ``{budget: ms}``, the replay time of the graph captured for ``budget`` (what the runner measures at
  capture).  A budget without a measurement (the tuner asks about budgets not captured yet) is read off the
  piecewise-linear curve through the measured points, extended past the ends with the nearest segment's slope
  (one point: flat below it, proportional above), never below 0.  Budget ``0`` (an empty path) costs 0.
- **attention** (optional): ``{path: ms per token^power}`` and ``attention_power`` ``{path: power}`` (2 where
  absent).  A replay's time depends on its content where the tower attends over whole images: the captured
  ``graph`` time is that of the budget as one attention sequence (what the runner times), and a batch of several
  items attends within each item.  With a coefficient ``a`` and a power ``q``, a batch whose sequences' lengths
  raised to ``q`` sum to ``s`` (its items' ``frames * (tokens / frames)^q`` plus the padding sequence's
  ``(budget - tokens)^q``) costs ``graph - a * (budget^q - s)``, never below 0
  (:mod:`encgraph.packing.attention_term`).  The runner measures ``a`` and ``q`` at capture from replays split
  into equal sequences at two budgets; without ``a`` (0) every replay costs ``graph``, as before.
- **eager**: for a batch with ``tokens > 0`` real tokens on the path and ``items`` items (0 when the path has no
  tokens), either the line ``fixed_ms + per_token_ms * tokens + per_item_ms * items``, or, where eager runs
  of one item were measured at two sizes or more (what the runner does at capture), the piecewise-linear
  curve through those times plus ``per_item_ms`` per further item.  The curve is what the planner needs: an
  eager forward costs a launch-bound floor at small sizes and grows faster than linearly at large ones
  (attention), and a line fitted through both ends predicts small runs far too cheap (measured on the H200:
  a 30-token Qwen3-VL item at 1.3 ms against 15.8 ms measured, so small items were sent eager).

>>> model = CostModel.from_measurements(
...     {"default": {256: 1.0, 1024: 3.0}},
...     {"default": [(64, 1, 5.25), (1024, 1, 9.0), (2048, 1, 13.0)]},
... )
>>> round(model.eager_cost("default", 512, 1), 3), round(model.graph_cost("default", 512), 3)
(7.0, 1.667)
>>> model.batch_cost({"default": 300}, {"default": 1024})
3.0
"""

from __future__ import annotations

import json
import os
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from encgraph._validate import check_int, check_mapping, check_path, describe
from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing.attention_term import DEFAULT_POWER, coef_table, item_term, power_table, with_squares
from encgraph.packing.eager_cost import EagerCost, eager_dict, fit_eager
from encgraph.packing.eager_cost import checked_ms as _ms
from encgraph.packing.crossover import Crossover, kernel_table

__all__ = ["CostModel", "Crossover", "EagerCost", "with_squares"]  # with_squares: from attention_term

_FORMAT = "encgraph.costs"
_VERSION = 1


def _graph_table(value: Any) -> dict[str, dict[int, float]]:
    check_mapping("CostModel(graph_ms)", value, hint="Pass {path: {budget: ms}}.")
    out: dict[str, dict[int, float]] = {}
    for path, table in value.items():
        check_path("CostModel(graph_ms) path name", path)
        check_mapping(f"CostModel(graph_ms[{path!r}])", table, hint="Pass {budget: ms} for the path's captured budgets.")
        if not table:
            raise ConfigError(
                f"CostModel(graph_ms[{path!r}]): expected at least one measured budget, got an empty mapping. "
                f"Time the replay of at least one captured budget of {path!r}."
            )
        row: dict[int, float] = {}
        for budget in table:
            b = int(budget) if isinstance(budget, str) and budget.isdigit() else budget  # JSON keys are str
            b = check_int(f"CostModel(graph_ms[{path!r}]) budget", b, minimum=1, hint="Budgets are token counts >= 1.")
            row[b] = _ms(f"CostModel(graph_ms[{path!r}][{b}])", table[budget])
        out[path] = dict(sorted(row.items()))
    return out


def _eager_table(value: Any) -> dict[str, EagerCost]:
    check_mapping("CostModel(eager)", value, hint="Pass {path: EagerCost(fixed_ms, per_token_ms)}.")
    out: dict[str, EagerCost] = {}
    for path, model in value.items():
        check_path("CostModel(eager) path name", path)
        if not isinstance(model, EagerCost):
            raise ConfigTypeError(f"CostModel(eager[{path!r}]): expected an EagerCost, got {describe(model)}.")
        out[path] = model
    return out


@attrs.frozen
class CostModel:
    """Expected times (ms) per path: graph replay per budget and an eager model (see the module docs).

    Attributes:
        graph_ms: ``{path: {budget: ms}}``, measured replay times (the budget as one attention sequence),
            budgets sorted.
        eager: ``{path: EagerCost}``; the same paths as ``graph_ms``.
        attention: ``{path: ms per token^power}``, the part of a replay that follows its sequences' lengths
            raised to the path's power (paths without one, or with 0, are left out: their replays cost
            ``graph_ms``).
        attention_power: ``{path: power}`` in ``[1.5, 2]``; a path left out has power 2.
        kernels: ``{key: Crossover}``, the attention-kernel crossovers measured at capture per device and head
            geometry (:mod:`encgraph.packing.crossover`): which kernel the eager forwards run for long sequences,
            so that the eager times above hold for a model loaded again.
    """

    graph_ms: dict[str, dict[int, float]] = attrs.field(converter=_graph_table, hash=False)
    eager: dict[str, EagerCost] = attrs.field(converter=_eager_table, hash=False)
    attention: dict[str, float] = attrs.field(factory=dict, converter=coef_table, hash=False, kw_only=True)
    attention_power: dict[str, float] = attrs.field(factory=dict, converter=power_table, hash=False, kw_only=True)
    kernels: dict[str, Crossover] = attrs.field(factory=dict, converter=kernel_table, hash=False, kw_only=True)
    _curves: dict[str, tuple[tuple[int, ...], tuple[float, ...]]] = attrs.field(
        init=False, eq=False, repr=False, hash=False
    )
    # Per (path, ladder) tuple of graph costs, filled on demand: the planner asks for the same ladders again.
    _ladder_cache: dict[tuple[str, tuple[int, ...]], tuple[float, ...]] = attrs.field(
        init=False, eq=False, repr=False, hash=False, factory=dict
    )
    # The cost-aware planner's per-(path, ladder) lookup tables (cost_pack._PathTable), built once per model.
    _table_cache: dict[tuple[str, tuple[int, ...]], Any] = attrs.field(
        init=False, eq=False, repr=False, hash=False, factory=dict
    )

    def __attrs_post_init__(self) -> None:
        if set(self.graph_ms) != set(self.eager):
            raise ConfigError(
                f"CostModel: expected the same paths in graph_ms and eager, got graph_ms {sorted(self.graph_ms)} "
                f"and eager {sorted(self.eager)}. Measure both the graphs and eager runs of every path."
            )
        for field in ("attention", "attention_power"):
            extra = sorted(set(getattr(self, field)) - set(self.graph_ms))
            if extra:
                raise ConfigError(
                    f"CostModel({field}): path {extra[0]!r} is not one of graph_ms's {sorted(self.graph_ms)}; give "
                    f"attention terms only for measured paths."
                )
        curves = {p: (tuple(t), tuple(t.values())) for p, t in self.graph_ms.items()}
        object.__setattr__(self, "_curves", curves)

    @property
    def paths(self) -> tuple[str, ...]:
        """The paths the model covers."""
        return tuple(self.graph_ms)

    def _path(self, where: str, path: Any) -> str:
        if path not in self.graph_ms:
            check_path(f"{where}(path)", path)
            raise ConfigError(
                f"{where}(path): expected one of the model's paths {list(self.graph_ms)}, got {path!r}. "
                f"Measure the path, or plan with a model that covers it."
            )
        return path

    def power(self, path: str) -> float:
        """The power of ``path``'s attention term (2 unless measured otherwise)."""
        return self.attention_power.get(path, DEFAULT_POWER)

    # -- costs --------------------------------------------------------------------------------------------

    def graph_cost(self, path: str, budget: int, squares: float | None = None) -> float:
        """Expected replay time (ms) of ``path``'s graph for ``budget`` (interpolated when not measured);
        with ``squares`` (the sum of the replay's sequences' lengths in tokens raised to the path's
        :meth:`power`, padding included) and an attention coefficient, the content-dependent cost of the module
        docs."""
        budgets, times = self._curves[self._path("CostModel.graph_cost", path)]
        b = check_int("CostModel.graph_cost(budget)", budget, minimum=0, hint="Budgets are token counts.")
        if b == 0:
            return 0.0
        k = bisect_left(budgets, b)
        if k < len(budgets) and budgets[k] == b:
            full = times[k]
        elif len(budgets) == 1:
            full = times[0] if b < budgets[0] else times[0] * b / budgets[0]
        else:
            lo = min(max(k - 1, 0), len(budgets) - 2)  # the segment around b, or the nearest one past the ends
            b0, b1, t0, t1 = budgets[lo], budgets[lo + 1], times[lo], times[lo + 1]
            full = max(0.0, t0 + (t1 - t0) * (b - b0) / (b1 - b0))
        a = self.attention.get(path, 0.0)
        if squares is None or not a:
            return full
        return with_squares(full, a, b, squares, self.power(path))

    def eager_cost(self, path: str, tokens: int, items: int = 1) -> float:
        """Expected eager time (ms) of ``tokens`` real tokens in ``items`` items on ``path`` (0.0 for none)."""
        model = self.eager[self._path("CostModel.eager_cost", path)]
        return model.cost(
            check_int("CostModel.eager_cost(tokens)", tokens, minimum=0),
            check_int("CostModel.eager_cost(items)", items, minimum=0),
        )

    def batch_cost(
        self,
        batch_tokens_per_path: Mapping[str, int],
        budgets: Mapping[str, int | None],
        *,
        items: int = 1,
        squares: Mapping[str, float] | None = None,
    ) -> float:
        """Expected time (ms) of one batch: per path, the graph of its budget, eager where the budget is
        ``None``, nothing where the path has no tokens; ``items`` counts for the eager per-item term.
        ``squares``: per path, the items' :func:`~encgraph.packing.attention_term.item_term` summed (the padding
        sequence is added here);
        without it a replay costs the budget's measured time."""
        check_mapping("CostModel.batch_cost(batch_tokens_per_path)", batch_tokens_per_path)
        check_mapping("CostModel.batch_cost(budgets)", budgets)
        total = 0.0
        for path, tokens in batch_tokens_per_path.items():
            if path not in budgets:
                raise ConfigError(
                    f"CostModel.batch_cost(budgets): missing path {path!r}; expected a budget (or None for eager) "
                    f"for every path of batch_tokens_per_path {list(batch_tokens_per_path)}."
                )
            budget = budgets[path]
            if not tokens:
                continue
            if budget is None:
                total += self.eager_cost(path, tokens, items)
            else:
                if budget < tokens:
                    raise ConfigError(
                        f"CostModel.batch_cost(budgets[{path!r}]): expected a budget >= the path's {tokens} tokens "
                        f"or None (eager), got {budget}."
                    )
                sq = None if squares is None or path not in squares else (
                    squares[path] + item_term(budget - tokens, 1, self.power(path)))
                total += self.graph_cost(path, budget, sq)
        return total

    def plan_cost(self, plan: Any, items: Sequence[Any] | None = None) -> float:
        """Expected time (ms) of every batch of ``plan`` (a :class:`~encgraph.packing.Plan`), summed; with the
        ``items`` it was planned from (:class:`~encgraph.packing.ItemSpec`), replays cost what their content
        does (the attention term), as the cost-aware planner reckons them."""
        total = 0.0
        for b in plan.batches:
            squares = None
            if items is not None and self.attention:
                squares = {p: sum(item_term(items[i].tokens.get(p, 0), items[i].frames, self.power(p)) for i in b.items)
                           for p in b.tokens}
            total += self.batch_cost(b.tokens, b.budgets, items=len(b.items), squares=squares)
        return total

    def _ladder_costs(self, path: str, ladder: tuple[int, ...]) -> tuple[float, ...]:
        key = (path, ladder)
        out = self._ladder_cache.get(key)
        if out is None:
            out = self._ladder_cache[key] = tuple(self.graph_cost(path, b) for b in ladder)
        return out

    def scaled(self, *, graph: Mapping[str, float] | None = None, eager: Mapping[str, float] | None = None) -> CostModel:
        """A model whose replay times (and attention coefficient) of each path in ``graph``, and eager times of each
        path in ``eager``, are multiplied by the given factor (> 0); other paths unchanged. The runner applies it
        when what it measures while serving departs from what the model predicted
        (:mod:`encgraph.capture.feedback`).

        >>> m = CostModel.linear(["default"], graph_fixed_ms=1, graph_per_budget_ms=0, eager_fixed_ms=2,
        ...                      eager_per_token_ms=0)
        >>> s = m.scaled(graph={"default": 3.0})
        >>> s.graph_cost("default", 64), s.eager_cost("default", 64)
        (3.0, 2.0)
        """
        graph, eager = dict(graph or {}), dict(eager or {})
        for where, table in (("graph", graph), ("eager", eager)):
            for path, factor in table.items():
                self._path(f"CostModel.scaled({where})", path)
                if not _ms(f"CostModel.scaled({where}[{path!r}])", factor):
                    raise ConfigError(f"CostModel.scaled({where}[{path!r}]): expected a factor > 0, got {factor}.")
        return CostModel(
            graph_ms={p: {b: ms * graph.get(p, 1.0) for b, ms in t.items()} for p, t in self.graph_ms.items()},
            eager={p: e.scaled(eager[p]) if p in eager else e for p, e in self.eager.items()},
            attention={p: a * graph.get(p, 1.0) for p, a in self.attention.items()},
            attention_power=self.attention_power,
            kernels=self.kernels,
        )

    # -- fitting ------------------------------------------------------------------------------------------

    @classmethod
    def from_measurements(
        cls,
        graph_ms: Mapping[str, Mapping[int, float]],
        eager_samples: Mapping[str, Sequence[tuple[int, int, float]]],
        attention: Mapping[str, float] | None = None,
        attention_power: Mapping[str, float] | None = None,
    ) -> CostModel:
        """Build a model from replay times and eager samples ``{path: [(tokens, items, ms), ...]}``.

        The eager model of each path is the least-squares fit of ``ms ~ fixed + per_token * tokens + per_item
        * items`` with every coefficient >= 0 (non-negative least squares, solved exactly by trying every
        subset of the three terms; a term the samples cannot tell apart from the others, such as ``items``
        when every sample has one item, is left at 0).  Where one-item samples cover two sizes or more, the
        model also carries their curve (repeated sizes averaged), which then gives the cost, and ``per_item``
        is refitted as the multi-item samples' least-squares excess over it (>= 0; 0 without such samples).
        Needs at least two samples per path.  ``attention``: ``{path: ms per token^power}`` and
        ``attention_power``: ``{path: power}`` as measured (see the module docs), or ``None``.
        """
        check_mapping("CostModel.from_measurements(eager_samples)", eager_samples, hint="Pass {path: [(tokens, items, ms)]}.")
        eager = {}
        for path, samples in eager_samples.items():
            check_path("CostModel.from_measurements(eager_samples) path name", path)
            eager[path] = fit_eager(f"CostModel.from_measurements(eager_samples[{path!r}])", samples)
        return cls(graph_ms=graph_ms, eager=eager, attention=attention, attention_power=attention_power)

    # -- serialisation ------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; :meth:`from_dict` turns it back into an equal model."""
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "paths": {
                p: {
                    "graph_ms": {str(b): ms for b, ms in self.graph_ms[p].items()},
                    "eager": eager_dict(self.eager[p]),
                    **({"attention": self.attention[p]} if p in self.attention else {}),
                    **({"attention_power": self.attention_power[p]} if p in self.attention_power else {}),
                }
                for p in self.graph_ms
            },
            **({"kernels": {k: c.to_dict() for k, c in self.kernels.items()}} if self.kernels else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        """Rebuild a model from :meth:`to_dict`'s output; validates everything."""
        check_mapping("CostModel.from_dict(data)", data, hint="Pass the dict that CostModel.to_dict() returned.")
        if data.get("format") != _FORMAT or data.get("version") != _VERSION:
            raise ConfigError(
                f"CostModel.from_dict(data): expected format {_FORMAT!r} version {_VERSION}, got format "
                f"{data.get('format')!r} version {data.get('version')!r}. Pass the dict CostModel.to_dict() returned."
            )
        paths = check_mapping("CostModel.from_dict(data['paths'])", data.get("paths"))
        graph, eager, attention, power = {}, {}, {}, {}
        for p, entry in paths.items():
            check_mapping(f"CostModel.from_dict(data['paths'][{p!r}])", entry)
            if "graph_ms" not in entry or "eager" not in entry:
                raise ConfigError(
                    f"CostModel.from_dict(data['paths'][{p!r}]): expected keys 'graph_ms' and 'eager', got "
                    f"{sorted(entry)}. Pass the dict CostModel.to_dict() returned."
                )
            graph[p] = entry["graph_ms"]
            if "attention" in entry:  # absent from files of before the attention term
                attention[p] = entry["attention"]
            if "attention_power" in entry:  # absent from files of before the power (and where it is 2)
                power[p] = entry["attention_power"]
            fields = check_mapping(f"CostModel.from_dict(data['paths'][{p!r}]['eager'])", entry["eager"])
            try:
                eager[p] = EagerCost(**fields)
            except TypeError as exc:
                raise ConfigError(f"CostModel.from_dict(data['paths'][{p!r}]['eager']): {exc}.") from None
        # "kernels" is absent from files of before the kernel crossover.
        return cls(graph_ms=graph, eager=eager, attention=attention, attention_power=power,
                   kernels=data.get("kernels"))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the model as JSON to the file ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModel:
        """Read a model that :meth:`save` wrote."""
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"CostModel.load(path): {os.fspath(path)!r} is not JSON ({exc}).") from None
        return cls.from_dict(data)

    @classmethod
    def linear(
        cls,
        paths: Sequence[str],
        *,
        graph_fixed_ms: float,
        graph_per_budget_ms: float,
        eager_fixed_ms: float,
        eager_per_token_ms: float,
    ) -> CostModel:
        """A model with graph cost ``graph_fixed_ms + graph_per_budget_ms * budget`` and eager cost
        ``eager_fixed_ms + eager_per_token_ms * tokens`` on every path (two graph points; the curve is exact)."""
        a = _ms("CostModel.linear(graph_fixed_ms)", graph_fixed_ms)
        b = _ms("CostModel.linear(graph_per_budget_ms)", graph_per_budget_ms)
        eager = EagerCost(eager_fixed_ms, eager_per_token_ms)
        return cls(graph_ms={p: {1: a + b, 1 << 20: a + b * (1 << 20)} for p in paths}, eager={p: eager for p in paths})

