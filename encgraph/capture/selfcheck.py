"""What ``capture()`` measures and checks on inputs the adapter synthesises: the self-check of every budget
and the default cost model; and the cost model ``measure_costs(samples)`` measures on given inputs.

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
from typing import Any

import numpy as np
import torch

from encgraph.capture.capture import fill_for_timing, time_replay
from encgraph.capture.execution import RunnerState, item_specs, run_static
from encgraph.capture.memory import release_cached
from encgraph.capture.protocol import BudgetUnit, FillRule
from encgraph.capture.records import RunMode
from encgraph.capture.timing import time_host, time_interleaved
from encgraph.packing import CostModel
from encgraph.packing.attention_term import DEFAULT_POWER, fit_power

__all__ = ["check_and_measure", "measure_cost_model", "tolerance", "relative_error", "timed_budgets", "SAMPLE_SIZES"]

log = logging.getLogger("encgraph")

SAMPLE_SIZES = 4
"""Eager timings per path for the cost model (one item each, spread over the ladder by index, and as many again
plus one by tokens: :func:`timed_budgets`), plus one sample of several items where the adapter can concatenate
inputs (so the per-item term can be fitted)."""
TIMING_ROUNDS = 3
"""Rounds of the interleaved eager / replay timing of each timed budget (minimum of each)."""
SPLIT_SEQUENCES = 16
"""Equal sequences one graph of a path is split into, for the attention term of the cost model."""
SPLIT_REPEATS = 3
"""Timed replays of each of that graph's two fills."""


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


def check_and_measure(runner: RunnerState, *, verify: bool, measure: bool) -> dict[str, Any]:
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
        checked[path] = {}
        positive = [b for b in ladder if b > 0]
        timed = timed_budgets(positive) if measure else set()
        eager[path] = []
        for budget in positive:
            if budget in runner.failed[path] and not runner.records[path].get(budget):
                continue
            try:
                _check_budget(runner, path, budget, positive, verify, budget in timed, checked[path], eager[path])
            except Exception as exc:  # capture-time work never fails a call: the budget goes, with its reason
                _drop(runner, path, budget, f"self-check: {type(exc).__name__}: {exc}", wide=False)
            release_cached(runner.device)  # the next sample's eager forward runs at another size
        if measure:
            try:
                eager[path].extend(_multi_item_sample(runner, path, positive))
            except Exception as exc:  # one sample fewer for the fit, never a failed call
                log.warning("encgraph: path %r: the multi-item eager sample failed (%s: %s); fitted without it.",
                            path, type(exc).__name__, exc)
    info["checked"] = checked
    if measure:
        attention = _attention_terms(runner)
        costs = _cost_model(runner, eager, {p: a for p, a in attention.items() if "coef" in a})
        if costs is not None:
            runner.costs = costs
            info["eager_samples"] = {p: [list(s) for s in v] for p, v in eager.items()}
            info["attention"] = attention
        else:
            info["costs"] = "greedy planner (too few eager samples)"
    info["seconds"] = round(time.perf_counter() - t0, 3)
    return info


def measure_cost_model(runner: RunnerState, samples: Sequence[Any], repeats: int) -> CostModel:
    """The cost model of ``runner.measure_costs(samples)`` (the runner captured): graph costs are each captured
    budget's replay time (timed at capture) or, outside GRAPH mode, the static forward's time on padding; eager
    costs are the adapter's eager forward timed on each sample input, fitted as fixed + per token + per item."""
    adapter = runner.adapter
    graph_ms: dict[str, dict[int, float]] = {}
    for path, ladder in runner.ladders.items():
        graph_ms[path] = {}
        for budget in (b for b in ladder if b > 0):
            record = runner.records[path].get(budget)
            if record is not None and record.replay_ms is not None:
                graph_ms[path][budget] = record.replay_ms
            elif runner.mode is not RunMode.GRAPH:
                views = runner.buffers[path].fill(budget, None)
                graph_ms[path][budget] = time_host(
                    lambda: adapter.forward_static(path, views, budget), repeats, runner.device
                )
    eager: dict[str, list[tuple[int, int, float]]] = {p: [] for p in runner.ladders}
    for sample in samples:
        specs = item_specs(adapter, sample)
        # select() gives the adapter's own inputs type, whatever form a call accepted (a raw tuple too).
        inputs = adapter.select(sample, list(range(len(specs))))
        for path in runner.ladders:
            tokens = sum(s.tokens[path] for s in specs)
            if tokens:
                ms = time_host(lambda: runner.compiled_eager.forward(adapter, path, inputs), repeats, runner.device)
                eager[path].append((tokens, sum(1 for s in specs if s.tokens[path]), ms))
    return CostModel.from_measurements(graph_ms, eager)


def _check_budget(runner: RunnerState, path: str, budget: int, positive: Sequence[int], verify: bool, timed: bool,
                  checked: dict[int, float], eager: list[tuple[int, int, float]]) -> None:
    """One budget's self-check (and eager timing when ``timed``) on the adapter's sample filling it in part."""
    adapter = runner.adapter
    sample = adapter.sample_inputs(path, _fill_size(positive, budget, runner.config.path(path).unit))
    specs = item_specs(adapter, sample)
    sub = adapter.select(sample, list(range(len(specs))))
    used = sum(s.tokens[path] for s in specs)
    if not 0 < used <= budget or len(specs) > runner.limits.max_items:
        return
    reference = adapter.forward_eager(path, sub)  # the plain eager forward: what every other run is checked by
    tol = tolerance(runner.config.dtype, runner.device)
    # The compiled eager forward (what serves eager batches) checked against it on each sample: it engages only
    # once checked, and stops at the first disagreement.
    runner.compiled_eager.check(adapter, path, sub, reference, relative_error, tol)
    if timed:
        # The eager sample and the budget's replay (as padding: what the model prices) timed in turn, so that
        # contention during capture weighs on both alike; the replay keeps its fastest time.
        fns = [lambda: runner.compiled_eager.forward(adapter, path, sub)]
        record = runner.records[path].get(budget)
        if record is not None and record.graph is not None and record.replay_ms is not None:
            fill_for_timing(runner, record)
            fns.append(record.graph.replay)
        times = time_interleaved(fns, TIMING_ROUNDS, runner.device)
        eager.append((used, sum(1 for s in specs if s.tokens[path]), times[0]))
        if len(times) > 1:
            record.replay_ms = min(record.replay_ms, times[1])
    if verify and budget not in runner.failed[path]:
        static = run_static(runner, path, budget, sub, used)
        worst = max((relative_error(static[n], reference[n]), n) for n in reference)
        checked[budget] = round(worst[0], 6) if math.isfinite(worst[0]) else worst[0]
        if not worst[0] <= tol:
            _drop(runner, path, budget, (
                f"self-check: output {worst[1]!r} of the padded static forward differs from the eager forward by "
                f"{worst[0]:.3g} (norm-relative; tolerance {tol:g})"))


def timed_budgets(ladder: Sequence[int]) -> set[int]:
    """The budgets of ``ladder`` (ascending, positive) whose eager samples are timed for the eager curve:
    :data:`SAMPLE_SIZES` spread by index (a ladder is dense at small budgets, where eager is launch-bound) and
    ``SAMPLE_SIZES + 1`` spread by tokens, ends included. Why the second: at large budgets attention makes eager
    time convex in tokens, so the curve's chord between two far-apart samples prices eager too high in between
    (measured on an H200, Qwen3-VL-8B: samples at 1,406 and 3,968 tokens priced a 2,301-token image 69 ms against
    a 70 ms replay; it replayed in 76 ms, where eager took 69)."""
    if len(ladder) <= SAMPLE_SIZES:
        return set(ladder)
    picks = {ladder[round(i * (len(ladder) - 1) / (SAMPLE_SIZES - 1))] for i in range(SAMPLE_SIZES)}
    lo, hi = ladder[0], ladder[-1]
    for i in range(SAMPLE_SIZES + 1):
        target = lo + i * (hi - lo) / SAMPLE_SIZES
        picks.add(min(ladder, key=lambda b: abs(b - target)))
    return picks


def _multi_item_sample(runner: RunnerState, path: str, ladder: Sequence[int]) -> list[tuple[int, int, float]]:
    adapter = runner.adapter
    if not hasattr(adapter, "concat") or runner.limits.max_items < 2:
        return []
    items = min(4, runner.limits.max_items)
    unit = runner.config.path(path).unit
    each = 1 if unit is BudgetUnit.ITEMS else max(1, ladder[len(ladder) // 2] // items)
    sample = adapter.concat([adapter.sample_inputs(path, each) for _ in range(items)])
    specs = item_specs(adapter, sample)
    sub = adapter.select(sample, list(range(len(specs))))
    used = sum(s.tokens[path] for s in specs)
    if not used:
        return []
    ms = time_host(lambda: runner.compiled_eager.forward(adapter, path, sub), 2, runner.device)
    return [(used, sum(1 for s in specs if s.tokens[path]), ms)]


def _drop(runner: RunnerState, path: str, budget: int, reason: str, *, wide: bool = True) -> None:
    # An adapter whose padding assumption is module-wide (the generic adapter: rows never mix across the batch)
    # learns that it does not hold, and every budget of the path goes (``wide``: a disagreement, not an error).
    hook = getattr(runner.adapter, "selfcheck_failed", None) if wide else None
    drop = [b for b in runner.ladders[path] if b > 0] if hook is not None and hook(path, budget, reason) else [budget]
    for b in drop:
        runner.failed[path].setdefault(b, reason)
        runner.records[path].pop(b, None)
    log.warning(
        "encgraph: path %r budget %d dropped: %s; its batches run at the next budget or eagerly. A module that "
        "mixes rows across the batch is not batch-first: wrap it with a model adapter, or pass verify=False to "
        "keep the budget anyway.", path, budget, reason
    )


def _cost_model(
    runner: RunnerState, eager: Mapping[str, list[tuple[int, int, float]]], attention: Mapping[str, Mapping[str, Any]]
) -> CostModel | None:
    graph_ms = {
        path: {b: r.replay_ms for b, r in records.items() if r.replay_ms is not None}
        for path, records in runner.records.items()
    }
    if any(not graph_ms[p] or len(eager.get(p, ())) < 2 for p in runner.ladders):
        return None
    measured = {p: a for p, a in attention.items() if graph_ms.get(p)}
    return CostModel.from_measurements(graph_ms, eager, {p: a["coef"] for p, a in measured.items()},
                                       {p: a["power"] for p, a in measured.items()})


def _attention_terms(runner: RunnerState) -> dict[str, dict[str, Any]]:
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
