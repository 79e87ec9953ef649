"""The content-dependent part of a replay's price: attention over each sequence, a power of its length.

A captured graph's replay time is measured with its buffers holding one attention sequence over the whole budget.
A replay of several items attends within each item's sequences, which costs less where a tower attends over whole
images. The attention of one sequence of ``n`` tokens costs about ``coef * n ** power``: ``power`` 2 where the
kernel runs at one efficiency at every length, less where it gets more efficient with length (Flash varlen on an
H200 at head dim 72: the measured per-token^2 cost of Qwen3-VL-8B's tower falls about 20% from 1,088 to 4,096
tokens, a power of about 1.83). So a replay of budget ``b`` whose sequences' lengths raised to ``power`` sum to
``s`` (its items' :func:`item_term` plus the padding sequence's ``(b - tokens) ** power``) costs
``full - coef * (b ** power - s)``, ``s`` clipped to ``[0, b ** power]``, never below 0.

Pure Python: importing it never imports torch.

>>> round(item_term(1200, 1, 2.0)), round(item_term(1200, 2, 2.0))
(1440000, 720000)
>>> with_squares(10.0, 1e-6, 1000, 0.0)
9.0
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from encgraph._validate import check_mapping, check_path
from encgraph.errors import ConfigError
from encgraph.packing.eager_cost import checked_ms

__all__ = ["DEFAULT_POWER", "MIN_POWER", "MAX_POWER", "item_term", "with_squares", "fit_power", "coef_table",
           "power_table"]

DEFAULT_POWER = 2.0
"""Attention's cost grows with the square of a sequence's length where nothing else is known."""
MIN_POWER = 1.5
MAX_POWER = 2.0
"""The powers a model accepts (and a fit is clipped to): attention never costs less than linear-and-a-half in a
sequence's length over the lengths a ladder spans, nor more than quadratic."""


def item_term(tokens: float, frames: int, power: float) -> float:
    """One item's part of a replay's sum: ``frames`` sequences of ``tokens / frames`` tokens each, each length
    raised to ``power`` (``tokens ** 2 / frames`` at the default power)."""
    if power == 2.0:  # the common case, and the one the tests of before the power compare exactly
        return float(tokens) * float(tokens) / frames
    return frames * (float(tokens) / frames) ** power


def with_squares(full: float, coef: float, budget: int, squares: float, power: float = DEFAULT_POWER) -> float:
    """A replay's cost from its budget's measured ``full`` time (one sequence of ``budget`` tokens), the path's
    attention ``coef`` (ms per token^``power``) and the replay's ``squares`` (its sequences' lengths raised to
    ``power``, summed): ``full - coef * (budget ** power - squares)``, ``squares`` clipped to
    ``[0, budget ** power]``, never below 0. The planner's vectorised form (``cost_pack``) computes the same."""
    b2 = float(budget) * float(budget) if power == 2.0 else float(budget) ** power
    s = min(max(float(squares), 0.0), b2)
    return max(0.0, full - coef * (b2 - s))


def fit_power(budgets: tuple[int, int], deltas: tuple[float, float]) -> float:
    """The power of the attention term from two measurements of ``delta = full - split`` (one replay as one
    sequence, then split into the same number of equal sequences) at two budgets: ``delta`` is proportional to
    ``budget ** power`` at a fixed split, so ``power = log(delta_1 / delta_0) / log(budget_1 / budget_0)``,
    clipped to ``[MIN_POWER, MAX_POWER]``; :data:`DEFAULT_POWER` where either delta is not positive or the
    budgets are equal (nothing to fit)."""
    (b0, b1), (d0, d1) = budgets, deltas
    if d0 <= 0.0 or d1 <= 0.0 or b0 == b1:
        return DEFAULT_POWER
    return min(max(math.log(d1 / d0) / math.log(b1 / b0), MIN_POWER), MAX_POWER)


def _per_path(field: str, value: Any, hint: str) -> Iterator[tuple[str, float]]:
    """``(path, value)`` of ``CostModel(<field>)``, a ``{path: float}``: each path name checked, each value a finite
    number >= 0."""
    check_mapping(f"CostModel({field})", value, hint=hint)
    for path, v in value.items():
        check_path(f"CostModel({field}) path name", path)
        yield path, checked_ms(f"CostModel({field}[{path!r}])", v)


def coef_table(value: Any) -> dict[str, float]:
    """``CostModel(attention)``: ``{path: ms per token^power}``, zeros dropped."""
    if value is None:
        return {}
    hint = "Pass {path: ms per token^power} (or None for none)."
    return {path: c for path, c in _per_path("attention", value, hint) if c}


def power_table(value: Any) -> dict[str, float]:
    """``CostModel(attention_power)``: ``{path: power}`` in ``[MIN_POWER, MAX_POWER]``; the default power is
    dropped (a path without an entry has it)."""
    if value is None:
        return {}
    out: dict[str, float] = {}
    for path, p in _per_path("attention_power", value, "Pass {path: power} (or None: every path at 2)."):
        if not MIN_POWER <= p <= MAX_POWER:
            raise ConfigError(
                f"CostModel(attention_power[{path!r}]): expected a power in [{MIN_POWER}, {MAX_POWER}], got {p}. "
                f"Fit it with fit_power (clipped to that range), or leave the path out for {DEFAULT_POWER}."
            )
        if p != DEFAULT_POWER:
            out[path] = p
    return out
