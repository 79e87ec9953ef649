"""The attention term of the default cost model (``CostModel.attention``, ``attention_power``), measured at
capture on replays of the captured graphs (:class:`~encgraph.capture.selfcheck.SelfCheck`, after the capture)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from encgraph.capture.capture import time_replay
from encgraph.capture.execution import RunnerState
from encgraph.capture.protocol import BudgetUnit, FillRule
from encgraph.packing.attention_term import DEFAULT_POWER, fit_power

__all__ = ["SPLIT_REPEATS", "SPLIT_SEQUENCES", "attention_terms"]

log = logging.getLogger("encgraph")

SPLIT_SEQUENCES = 16
"""Equal sequences one graph of a path is split into, for the attention term of the cost model."""
SPLIT_REPEATS = 3
"""Timed replays of each of that graph's two fills."""


def attention_terms(runner: RunnerState) -> dict[str, dict[str, Any]]:
    """Per path, the cost model's attention term (``CostModel.attention``, ``attention_power``) and how it was
    measured.

    The replay times of capture fill each graph's buffers as padding: one attention sequence over the whole
    budget (in buffers whose padding is not chunked: full attention). A batch of several items attends within
    each, which costs less where a tower attends over whole images (Qwen3-VL-8B on an H200: 29.6 ms for budget
    1280 as one sequence, 67.6 ms for 2240; two 1100-token images would not share one replay at those prices).
    So one graph of each token-budget path (the smallest budget of at least a quarter of the largest: a clear
    attention share at a fraction of the largest replay's time) is timed with those buffers split into
    :data:`SPLIT_SEQUENCES` equal sequences, right after a timing of the one-sequence fill, and so is the largest
    graph where it is at least twice that budget. Attention over one sequence of ``n`` tokens costs about
    ``coef * n^q``, so ``full - split = coef * budget^q * (1 - k^(1 - q))`` at both: ``q`` is fitted from the two
    (:func:`~encgraph.packing.attention_term.fit_power`: Flash varlen gets more efficient with length, about 1.83
    for Qwen3-VL-8B on an H200; 2 from one budget), ``coef`` the geometric mean of what each budget gives at that
    ``q``. Paths whose budgets count items, or with
    no unchunked sequence-bounds buffer, or too few sequence slots, get none (their entry says why); a failure is
    logged and leaves the path without the term (replays then cost their measured times, as before)."""
    out: dict[str, dict[str, Any]] = {}
    for path, records in runner.records.items():
        try:
            out[path] = _attention_term(runner, path, records)
        except Exception as exc:  # measurement only: the model then prices replays as measured
            log.warning("encgraph: path %r: the attention term of the cost model was not measured (%s: %s); "
                        "replays are priced at their measured times.", path, type(exc).__name__, exc)
            out[path] = {"skipped": f"{type(exc).__name__}: {exc}"}
    return out


def _attention_term(runner: RunnerState, path: str, records: Mapping[int, Any]) -> dict[str, Any]:
    timed = {b: r for b, r in records.items() if r.replay_ms is not None and r.graph is not None}
    if runner.config.path(path).unit is BudgetUnit.ITEMS or not timed:
        return {"skipped": "budgets count items" if timed else "no timed graph"}
    budget = min(b for b in timed if 4 * b >= max(timed))
    fitted = [budget] + ([max(timed)] if max(timed) >= 2 * budget else [])
    bounds = {}
    for b in fitted:
        bounds[b] = {n: sp for n, sp in runner.buffers[path].specs[b].items()
                     if sp.fill is FillRule.SEQUENCE_BOUNDS and sp.total and sp.chunk >= sp.total}
    k = min([SPLIT_SEQUENCES] + [sp.shape[0] - 1 for bs in bounds.values() for sp in bs.values()])
    if not bounds[budget] or k < 2:
        return {"skipped": "no full-attention sequence bounds" if not bounds[budget] else "too few sequence slots"}
    full, split = [], []
    for b in fitted:
        cuts = {n: np.linspace(0, sp.total, k + 1).round().astype(np.int64) for n, sp in bounds[b].items()}
        full.append(time_replay(runner, timed[b], SPLIT_REPEATS))
        split.append(time_replay(runner, timed[b], SPLIT_REPEATS, cuts))
    deltas = [max(0.0, f - s) for f, s in zip(full, split)]
    power = round(fit_power((fitted[0], fitted[-1]), (deltas[0], deltas[-1])), 4) if len(fitted) == 2 else (
        DEFAULT_POWER)
    share = 1.0 - float(k) ** (1.0 - power)  # of a budget's attention, what splitting it in k saves
    coefs = [d / (float(b) ** power * share) for b, d in zip(fitted, deltas)]
    coef = math.prod(coefs) ** (1.0 / len(coefs)) if all(coefs) else max(coefs)
    out = {"budget": budget, "sequences": k, "full_ms": round(full[0], 4), "split_ms": round(split[0], 4),
           "coef": coef, "power": power}
    if len(fitted) == 2:
        out["fit"] = {"budget": fitted[1], "full_ms": round(full[1], 4), "split_ms": round(split[1], 4)}
    return out
