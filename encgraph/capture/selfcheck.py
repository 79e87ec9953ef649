"""What ``capture()`` measures and checks on inputs the adapter synthesises: the self-check of every budget
and the default cost model.

**Self-check** (``verify=True``, the default): for every budget of every path, the adapter's
``sample_inputs(path, tokens)`` gives a sub-batch that fills the budget only in part (so padding is present),
which runs once through the padded static forward (in GRAPH mode: the captured graph itself) and once through
the eager forward on exactly its items. A budget whose outputs disagree beyond the dtype's tolerance (norm-relative
error of any output) is dropped, with the reason logged and kept in ``runner.failed`` / ``capture_info``: its
batches then move to the next budget or run eagerly. This catches modules that are not batch-first or that mix
rows across the batch (a generic adapter is right for them only when the batch equals a budget).

**Cost model** (``costs=None`` in GRAPH mode, the default): the replay time of every captured budget (timed
at capture) and eager timings of a few sample sizes per path (fitted as fixed + per token + per item) give a
:class:`~encgraph.packing.CostModel`; every call is then planned by the cost-aware packer, which never replays a
budget the model says costs more than running the batch eagerly.

Adapters without ``sample_inputs`` skip both: a log line says so, ``capture_info`` records why, and the runner
plans greedily.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from encgraph.capture.protocol import BudgetUnit
from encgraph.packing import CostModel

if TYPE_CHECKING:  # pragma: no cover
    from encgraph.capture.runner import EncoderGraphRunner

__all__ = ["check_and_measure", "tolerance", "relative_error", "SAMPLE_SIZES"]

log = logging.getLogger("encgraph")

SAMPLE_SIZES = 4
"""Eager timings per path for the cost model (one item each, geometrically spread over the ladder), plus one
sample of several items where the adapter can concatenate inputs (so the per-item term can be fitted)."""


def tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """Norm-relative agreement expected between the padded static forward and the eager forward."""
    if dtype in (torch.float16, torch.bfloat16):
        return 5e-2  # different kernels (max_seqlen, batch shape) round 2-byte floats differently
    if device.type == "cuda":
        return 1e-2  # TF32 matmuls may be on
    return 1e-3


def relative_error(static: torch.Tensor, eager: torch.Tensor) -> float:
    """``||static - eager|| / ||eager||`` in float64 (``inf`` for a shape mismatch or non-finite static rows
    where eager is finite)."""
    if static.shape != eager.shape:
        return math.inf
    a, b = static.detach().double(), eager.detach().double()
    finite = torch.isfinite(b)
    if not bool(torch.isfinite(a[finite]).all()):
        return math.inf
    diff = torch.linalg.vector_norm((a - b)[finite])
    ref = torch.linalg.vector_norm(b[finite])
    return float(diff / ref) if float(ref) > 0 else float(diff)


def _fill_size(ladder: Sequence[int], budget: int, unit: BudgetUnit) -> int:
    """Tokens for a sample planned into ``budget``: past the budget below it, short of ``budget`` itself."""
    below = max((b for b in ladder if 0 < b < budget), default=0)
    if unit is BudgetUnit.ITEMS:
        return max(1, budget - 1) if budget > below + 1 else budget
    return max(below + 1, budget - max(1, (budget - below) // 2))


def check_and_measure(runner: EncoderGraphRunner, *, verify: bool, measure: bool) -> dict[str, Any]:
    """Run the self-check (``verify``) and build the default cost model (``measure``; GRAPH mode) on sample
    inputs; returns the summary for ``capture_info["selfcheck"]``. Sets ``runner.costs`` when measuring."""
    adapter = runner.adapter
    info: dict[str, Any] = {"verify": verify, "costs": "measured" if measure else "not measured"}
    if not (verify or measure):
        return info
    if not hasattr(adapter, "sample_inputs"):
        why = f"{type(adapter).__name__} has no sample_inputs(path, tokens)"
        info.update(skipped=why, costs="greedy planner (no cost model)" if measure else info["costs"])
        log.info("encgraph: self-check and default cost model skipped: %s.", why)
        return info
    t0 = time.perf_counter()
    checked: dict[str, dict[int, float]] = {}
    eager: dict[str, list[tuple[int, int, float]]] = {}
    for path, ladder in runner.ladders.items():
        spec = runner.config.path(path)
        checked[path] = {}
        positive = [b for b in ladder if b > 0]
        timed = _timed_budgets(positive) if measure else set()
        eager[path] = []
        for budget in positive:
            if budget in runner.failed[path] and not runner.records[path].get(budget):
                continue
            sample = adapter.sample_inputs(path, _fill_size(positive, budget, spec.unit))
            specs = runner._specs(sample)
            sub = adapter.select(sample, list(range(len(specs))))
            used = sum(s.tokens[path] for s in specs)
            if not 0 < used <= budget or len(specs) > runner.limits.max_items:
                continue
            reference = adapter.forward_eager(path, sub)
            if budget in timed:
                ms = runner._time_host(lambda: adapter.forward_eager(path, sub), 2)
                eager[path].append((used, sum(1 for s in specs if s.tokens[path]), ms))
            if verify and budget not in runner.failed[path]:
                static = runner._run_static(path, budget, sub, used)
                worst = max((relative_error(static[n], reference[n]), n) for n in reference)
                checked[path][budget] = round(worst[0], 6) if math.isfinite(worst[0]) else worst[0]
                tol = tolerance(runner.config.dtype, runner.device)
                if not worst[0] <= tol:
                    _drop(runner, path, budget, worst, tol)
        if measure:
            eager[path].extend(_multi_item_sample(runner, path, positive))
    info["checked"] = checked
    if measure:
        costs = _cost_model(runner, eager)
        if costs is not None:
            runner.costs = costs
            info["eager_samples"] = {p: [list(s) for s in v] for p, v in eager.items()}
        else:
            info["costs"] = "greedy planner (too few eager samples)"
    info["seconds"] = round(time.perf_counter() - t0, 3)
    return info


def _timed_budgets(ladder: Sequence[int]) -> set[int]:
    if len(ladder) <= SAMPLE_SIZES:
        return set(ladder)
    picks = {ladder[round(i * (len(ladder) - 1) / (SAMPLE_SIZES - 1))] for i in range(SAMPLE_SIZES)}
    return picks


def _multi_item_sample(runner: EncoderGraphRunner, path: str, ladder: Sequence[int]) -> list[tuple[int, int, float]]:
    adapter = runner.adapter
    if not hasattr(adapter, "concat") or runner.limits.max_items < 2:
        return []
    items = min(4, runner.limits.max_items)
    unit = runner.config.path(path).unit
    each = 1 if unit is BudgetUnit.ITEMS else max(1, ladder[len(ladder) // 2] // items)
    sample = adapter.concat([adapter.sample_inputs(path, each) for _ in range(items)])
    specs = runner._specs(sample)
    sub = adapter.select(sample, list(range(len(specs))))
    used = sum(s.tokens[path] for s in specs)
    if not used:
        return []
    ms = runner._time_host(lambda: adapter.forward_eager(path, sub), 2)
    return [(used, sum(1 for s in specs if s.tokens[path]), ms)]


def _drop(runner: EncoderGraphRunner, path: str, budget: int, worst: tuple[float, str], tol: float) -> None:
    reason = (
        f"self-check: output {worst[1]!r} of the padded static forward differs from the eager forward by "
        f"{worst[0]:.3g} (norm-relative; tolerance {tol:g})"
    )
    # An adapter whose padding assumption is module-wide (the generic adapter: rows never mix across the batch)
    # learns that it does not hold, and every budget of the path goes.
    hook = getattr(runner.adapter, "selfcheck_failed", None)
    drop = [b for b in runner.ladders[path] if b > 0] if hook is not None and hook(path, budget, reason) else [budget]
    for b in drop:
        runner.failed[path].setdefault(b, reason)
        runner.records[path].pop(b, None)
    log.warning(
        "encgraph: path %r budget %d dropped: %s; its batches run at the next budget or eagerly. A module that "
        "mixes rows across the batch is not batch-first: wrap it with a model adapter, or pass verify=False to "
        "keep the budget anyway.", path, budget, reason
    )


def _cost_model(runner: EncoderGraphRunner, eager: Mapping[str, list[tuple[int, int, float]]]) -> CostModel | None:
    graph_ms = {
        path: {b: r.replay_ms for b, r in records.items() if r.replay_ms is not None}
        for path, records in runner.records.items()
    }
    if any(not graph_ms[p] or len(eager.get(p, ())) < 2 for p in runner.ladders):
        return None
    return CostModel.from_measurements(graph_ms, eager)
