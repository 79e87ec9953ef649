"""The eager cost of one path: a fitted line, or the measured one-item curve plus a per-item excess (or, where
every sample has the same tokens per item, the curve through all samples by tokens).

Part of the cost model (:mod:`encgraph.packing.costs`, which re-exports :class:`EagerCost`); times are
milliseconds. Pure Python + numpy: importing it never imports torch.
"""

from __future__ import annotations

import math
import numbers
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from encgraph._validate import check_int, check_sequence, describe
from encgraph.errors import ConfigError, ConfigTypeError

__all__ = ["EagerCost", "checked_ms", "eager_dict", "fit_eager"]


def checked_ms(name: str, value: Any) -> float:
    """A finite, non-negative time in ms as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigTypeError(f"{name}: expected a number of milliseconds, got {describe(value)}.")
    out = float(value)
    if not math.isfinite(out) or out < 0:
        raise ConfigError(f"{name}: expected a finite time >= 0 ms, got {value!r}. Pass a measured time in ms.")
    return out


def _check_ms(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    checked_ms(f"EagerCost({attribute.name})", value)


def _curve(value: Any) -> tuple[tuple[int, float], ...]:
    """``((tokens, ms), ...)``: tokens strictly increasing (>= 1), ms finite and >= 0; empty or >= 2 points."""
    if value is None or (isinstance(value, Sequence) and not value):
        return ()
    check_sequence("EagerCost(curve)", value, hint="Pass ((tokens, ms), ...) of one-item eager runs.")
    out: list[tuple[int, float]] = []
    for i, point in enumerate(value):
        if not isinstance(point, Sequence) or isinstance(point, (str, bytes)) or len(point) != 2:
            raise ConfigTypeError(f"EagerCost(curve[{i}]): expected a (tokens, ms) pair, got {describe(point)}.")
        t = check_int(f"EagerCost(curve[{i}]) tokens", point[0], minimum=1)
        if out and t <= out[-1][0]:
            raise ConfigError(
                f"EagerCost(curve[{i}]): expected tokens above the previous point's {out[-1][0]}, got {t}. Sort "
                f"the points by tokens and merge repeated sizes."
            )
        out.append((t, checked_ms(f"EagerCost(curve[{i}]) ms", point[1])))
    if len(out) < 2:
        raise ConfigError(
            f"EagerCost(curve): expected at least 2 points (or none), got {len(out)}. Time one-item eager runs "
            f"at two sizes or more, or leave the curve out for the line."
        )
    return tuple(out)


@attrs.frozen
class EagerCost:
    """The eager cost model of one path (ms), see the module docs.

    Without ``curve``: ``fixed_ms + per_token_ms * tokens + per_item_ms * items``.  With ``curve`` (one-item eager
    times ``((tokens, ms), ...)``, or any samples' where tokens per item never vary, with ``per_item_ms`` 0): the
    piecewise-linear curve through its points, made non-decreasing (an eager
    run is never predicted cheaper than a smaller one), flat below the first point (a small run is launch-bound),
    extended past the last one with the last segment's slope; plus ``per_item_ms * (items - 1)``.  ``fixed_ms`` and
    ``per_token_ms`` are then the fitted line, kept for reports only.

    >>> EagerCost(2.0, 0.01).cost(100, 1)
    3.0
    >>> e = EagerCost(0.0, 0.0, 0.5, curve=((100, 10.0), (1000, 19.0), (2000, 49.0)))
    >>> e.cost(50, 1), e.cost(550, 1), e.cost(3000, 1), e.cost(1000, 3)
    (10.0, 14.5, 79.0, 20.0)
    """

    fixed_ms: float = attrs.field(converter=float, validator=_check_ms)
    per_token_ms: float = attrs.field(converter=float, validator=_check_ms)
    per_item_ms: float = attrs.field(default=0.0, converter=float, validator=_check_ms)
    curve: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_curve)
    # The curve as the planner reads it: knots, non-decreasing times, per-segment slopes (numpy and tuples).
    _knots: tuple[Any, ...] = attrs.field(init=False, eq=False, repr=False, hash=False)

    def __attrs_post_init__(self) -> None:
        if not self.curve:
            object.__setattr__(self, "_knots", ())
            return
        xs = tuple(float(t) for t, _ in self.curve)
        ys = tuple(float(v) for v in np.maximum.accumulate([ms for _, ms in self.curve]))
        slopes = tuple((ys[k + 1] - ys[k]) / (xs[k + 1] - xs[k]) for k in range(len(xs) - 1))
        arrays = (np.asarray(xs), np.asarray(ys[:-1]), np.asarray(slopes))
        object.__setattr__(self, "_knots", (xs, ys, slopes, arrays))

    def scaled(self, factor: float) -> EagerCost:
        """This model with every time multiplied by ``factor`` (> 0): what the runner's cost correction applies
        when eager runs measured while serving take ``factor`` times what the model predicted.

        >>> EagerCost(2.0, 0.01, curve=((100, 3.0), (200, 5.0))).scaled(2.0).cost(150, 1)
        8.0
        """
        f = checked_ms("EagerCost.scaled(factor)", factor)
        return EagerCost(self.fixed_ms * f, self.per_token_ms * f, self.per_item_ms * f,
                         curve=tuple((t, ms * f) for t, ms in self.curve))

    def cost(self, tokens: int, items: int) -> float:
        """Expected eager time (ms) of ``tokens`` real tokens in ``items`` items; 0.0 for no tokens."""
        if tokens <= 0:
            return 0.0
        if not self._knots:
            return self.fixed_ms + self.per_token_ms * tokens + self.per_item_ms * items
        xs, ys, slopes, _ = self._knots
        if tokens <= xs[0]:
            base = ys[0]
        else:
            k = min(bisect_left(xs, tokens) - 1, len(slopes) - 1)
            base = ys[k] + (tokens - xs[k]) * slopes[k]
        return base + self.per_item_ms * (items - 1)

    def cost_array(self, tokens: np.ndarray, items: np.ndarray) -> np.ndarray:
        """:meth:`cost` elementwise over int arrays (broadcast), the same sums in the same order (float64);
        entries with no tokens are not zeroed (the caller masks them)."""
        if not self._knots:
            return self.fixed_ms + self.per_token_ms * tokens + self.per_item_ms * items
        xs, _, _, (xs_np, ys_np, slopes_np) = self._knots
        k = np.searchsorted(xs_np, tokens, side="left") - 1
        np.clip(k, 0, len(slopes_np) - 1, out=k)
        base = ys_np[k] + (tokens - xs_np[k]) * slopes_np[k]
        base = np.where(tokens <= xs[0], ys_np[0], base)
        return base + self.per_item_ms * (items - 1)


_TERMS = ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,))


def eager_dict(model: EagerCost) -> dict[str, Any]:
    out: dict[str, Any] = {"fixed_ms": model.fixed_ms, "per_token_ms": model.per_token_ms,
                           "per_item_ms": model.per_item_ms}
    if model.curve:
        out["curve"] = [list(point) for point in model.curve]
    return out


def fit_eager(where: str, samples: Any) -> EagerCost:
    check_sequence(where, samples, hint="Pass a list of (tokens, items, ms) tuples.")
    rows = []
    for i, s in enumerate(samples):
        if not isinstance(s, Sequence) or isinstance(s, (str, bytes)) or len(s) != 3:
            raise ConfigTypeError(f"{where}[{i}]: expected a (tokens, items, ms) tuple, got {describe(s)}.")
        rows.append(
            (
                check_int(f"{where}[{i}] tokens", s[0], minimum=1, hint="Time eager runs of at least one token."),
                check_int(f"{where}[{i}] items", s[1], minimum=1),
                checked_ms(f"{where}[{i}] ms", s[2]),
            )
        )
    if len(rows) < 2:
        raise ConfigError(
            f"{where}: expected at least 2 samples (tokens, items, ms), got {len(rows)}. Time eager runs of at "
            f"least two different sizes."
        )
    data = np.asarray(rows, dtype=np.float64)
    design = np.column_stack([np.ones(len(rows)), data[:, 0], data[:, 1]])
    y = data[:, 2]
    best: tuple[float, int, np.ndarray] | None = None
    scale = float(np.dot(y, y)) or 1.0
    for order, cols in enumerate(_TERMS):
        a = design[:, cols]
        if np.linalg.matrix_rank(a) < len(cols):
            continue  # a term the samples cannot identify
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        if (coef < 0).any():
            continue
        resid = float(np.sum((a @ coef - y) ** 2))
        key = round(resid / scale, 12)
        if best is None or key < best[0]:
            full = np.zeros(3)
            full[list(cols)] = coef
            best = (key, order, full)
    assert best is not None  # the one-term fits of non-negative times always qualify
    fixed, per_token, per_item = (max(0.0, float(c)) for c in best[2])
    singles: dict[int, list[float]] = {}
    for t, n, ms in rows:
        if n == 1:
            singles.setdefault(t, []).append(ms)
    if len(singles) < 2:
        if len({t for t, _, _ in rows}) >= 2 and all(t * rows[0][1] == rows[0][0] * n for t, n, _ in rows):
            # Every sample has the same tokens per item (a fixed-size tower: the budgets count images), so the
            # per-item term cannot be told from the per-token one: the curve through the samples by tokens. A line
            # fitted there bends with the launch-bound small batches and priced SigLIP-so400m's eager batch of 32
            # below its 52.4 ms replay on an H100 (fixed 5.0 + 1.46 ms an image: 51.7), where it took 55.
            by_tokens: dict[int, list[float]] = {}
            for t, _, ms in rows:
                by_tokens.setdefault(t, []).append(ms)
            points = tuple((t, float(np.mean(v))) for t, v in sorted(by_tokens.items()))
            return EagerCost(fixed, per_token, 0.0, curve=points)
        return EagerCost(fixed, per_token, per_item)
    curve = EagerCost(0.0, 0.0, curve=tuple((t, float(np.mean(v))) for t, v in sorted(singles.items())))
    # per_item_ms against the curve: least squares of the multi-item samples' excess, >= 0 (0 without any).
    extra = [(n - 1, ms - curve.cost(t, 1)) for t, n, ms in rows if n > 1]
    per_item = max(0.0, sum(a * r for a, r in extra) / sum(a * a for a, _ in extra)) if extra else 0.0
    return EagerCost(fixed, per_token, per_item, curve=curve.curve)
