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
:class:`~encgraph.packing.CostModel`; every call is then planned by the cost-aware packer, which runs a batch
eagerly only where the model prices that at least 5% under the replay (``EAGER_MARGIN``).

Adapters without ``sample_inputs`` skip both: a log line says so, ``capture_info`` records why, and the runner
plans greedily.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from encgraph.capture.agreement import relative_error, tolerance
from encgraph.capture.attention_timing import attention_terms
from encgraph.capture.execution import RunnerState, item_specs, run_static
from encgraph.capture.memory import peak_rise, release_cached
from encgraph.capture.protocol import BudgetUnit
from encgraph.capture.records import RunMode
from encgraph.capture.timing import PhaseClock, time_host
from encgraph.packing import CostModel

__all__ = ["SelfCheck", "check_and_measure", "measure_cost_model", "timed_budgets", "reference_chunk", "SAMPLE_SIZES"]

log = logging.getLogger("encgraph")

SAMPLE_SIZES = 4
"""Eager timings per path for the cost model (one item each, spread over the ladder by index, and as many again
plus one by tokens: :func:`timed_budgets`), plus one sample of several items where the adapter can concatenate
inputs (so the per-item term can be fitted)."""
TIMING_ROUNDS = 3
"""Spaced runs of each timed budget's eager sample (their minimum)."""


def _fill_size(ladder: Sequence[int], budget: int, unit: BudgetUnit) -> int:
    """Tokens for a sample planned into ``budget``: past the budget below it, short of ``budget`` itself."""
    below = max((b for b in ladder if 0 < b < budget), default=0)
    if unit is BudgetUnit.ITEMS:
        return max(1, budget - 1) if budget > below + 1 else budget
    return max(below + 1, budget - max(1, (budget - below) // 2))


def reference_chunk(ladder: Sequence[int]) -> int:
    """Most items of one reference forward on a batch ladder: the largest budget up to half the top one (the top
    itself for a ladder of one budget)."""
    return max((b for b in ladder if 2 * b <= ladder[-1]), default=ladder[-1])


def _parts(runner: RunnerState, path: str, sub: Any, specs: Sequence[Any], chunk: int) -> list[Any]:
    """The sub-batches a budget's sample is run eagerly in (the reference and the compiled eager check). Where every
    item is one row of every output (a one-path batch ladder: what ``runner.call_rows`` splits and joins the same
    way), a sample of more than ``chunk`` items runs in contiguous chunks of at most ``chunk``, their outputs joined
    along the rows: a forward at the top budget held the self-check's peak (SigLIP-so400m on an H100: 650 MiB
    allocated at 32 images, against 484 for the compiled warm-up and 528 for reduce-overhead's whole run). A module
    that mixes rows across the batch still disagrees with the padded replay, chunked or not."""
    adapter = runner.adapter
    rows = len(runner.config.path_names) == 1 and all(s.tokens[path] == 1 for s in specs)
    if not rows or len(specs) <= chunk:
        return [sub]
    return [adapter.select(sub, list(range(a, min(a + chunk, len(specs))))) for a in range(0, len(specs), chunk)]


def check_and_measure(runner: RunnerState, *, verify: bool, measure: bool) -> dict[str, Any]:
    """Both phases of a :class:`SelfCheck` at once (a runner with nothing captured in between: STATIC mode);
    returns the summary for ``capture_info["selfcheck"]``."""
    check = SelfCheck(runner, verify=verify, measure=measure)
    check.run_eager()
    return check.finish()


@attrs.define
class _Sample:
    """One budget's sample, run eagerly before the capture and replayed after it: the replay values of its
    sub-batch and the eager forward's outputs (the reference), both on the host, so that neither holds device
    memory while the graphs are captured; ``used``: its rows."""

    path: str
    budget: int
    values: dict[str, Any]
    used: int
    reference: dict[str, torch.Tensor]


class SelfCheck:
    """The self-check (``verify``) and the default cost model (``measure``; GRAPH mode) of one capture, on the
    adapter's sample inputs, in two phases around the graphs' capture, so that no eager forward runs while the
    graphs' pool is held (:mod:`encgraph.capture.capture`: the capture's peak is then one eager forward's
    activations or the pool, not both):

    - :meth:`run_eager`, before the first graph is captured (``before_capture``): per budget, the plain eager
      forward on the sample (the reference, kept on the host), the compiled eager forward's check against it, and
      the cost model's eager timings; the allocator's free cached segments go back after each sample;
    - :meth:`finish`, after: per budget, the padded static forward (in GRAPH mode: the graph's replay) on the
      same sample against its reference, a budget that disagrees dropped; the attention term (replays); the fit.

    Timing: an eager sample and its budget's replay are not timed in turn (interleaved, so that contention weighs
    on both alike), since a replay exists only after the capture and an eager forward may run only before it.
    Each side is timed alone as the minimum of spaced repeats (:mod:`encgraph.capture.timing`: a burst of
    contention rarely covers every one): the eager sample here, before the capture (:data:`TIMING_ROUNDS`); the
    replay by the capture's own timing (``replay_ms``, five repeats right after the capture).
    """

    def __init__(self, runner: RunnerState, *, verify: bool, measure: bool,
                 memory: dict[str, dict[str, float]] | None = None) -> None:
        self.runner = runner
        self.verify, self.measure = verify, measure
        self.info: dict[str, Any] = {"verify": verify, "costs": "measured" if measure else "not measured"}
        self.samples: list[_Sample] = []
        self.eager: dict[str, list[tuple[int, int, float]]] = {}
        self.seconds = 0.0
        self.clock = PhaseClock(runner.device)  # capture_info["selfcheck"]["phase_seconds"]
        self._memory = {} if memory is None else memory
        self._device = runner.device if runner.mode is RunMode.GRAPH else None  # peaks recorded in GRAPH mode

    @property
    def skipped(self) -> bool:
        return not (self.verify or self.measure) or "skipped" in self.info

    def run_eager(self) -> None:
        """The eager phase: references, compiled eager check, eager timings (see the class)."""
        runner, adapter = self.runner, self.runner.adapter
        if not (self.verify or self.measure):
            return
        if not hasattr(adapter, "sample_inputs"):
            why = f"{type(adapter).__name__} has no sample_inputs(path, tokens)"
            self.info.update(skipped=why, costs="greedy planner (no cost model)" if self.measure else self.info["costs"])
            log.info("encgraph: self-check and default cost model skipped: %s.", why)
            return
        t0 = time.perf_counter()
        # The warm-ups' cached segments go back first: the eager forwards below run at other sizes (and plain
        # where the warm-ups ran compiled), fit those segments only in part and would stack their own on top
        # (CLIP-L on an H100: +320 MiB reserved over the warm-ups' 540).
        clock = self.clock
        with clock("release cached"):
            release_cached(runner.device)
        with peak_rise(self._device, self._memory, "selfcheck eager"):
            hook = getattr(adapter, "check_before_capture", None)
            if self.verify and hook is not None:  # the adapter's own eager checks (the generic one's split check)
                with clock("adapter check"):
                    hook(tolerance(runner.config.dtype, runner.device))
            for path, ladder in runner.ladders.items():
                positive = [b for b in ladder if b > 0]
                timed = timed_budgets(positive) if self.measure else set()
                self.eager[path] = []
                for budget in positive:
                    if budget in runner.failed[path] and not runner.records[path].get(budget):
                        continue
                    try:
                        self._eager_budget(path, budget, positive, budget in timed)
                    except Exception as exc:  # capture-time work never fails a call: the budget goes, with its reason
                        _drop(runner, path, budget, f"self-check: {type(exc).__name__}: {exc}", wide=False)
                    with clock("release cached"):
                        release_cached(runner.device)  # the next sample's eager forward runs at another size
                if self.measure:
                    try:
                        with clock("multi-item sample"):
                            self.eager[path].extend(_multi_item_sample(runner, path, positive))
                    except Exception as exc:  # one sample fewer for the fit, never a failed call
                        log.warning("encgraph: path %r: the multi-item eager sample failed (%s: %s); fitted without "
                                    "it.", path, type(exc).__name__, exc)
                    with clock("release cached"):
                        release_cached(runner.device)
        self.seconds += time.perf_counter() - t0

    def _eager_budget(self, path: str, budget: int, positive: Sequence[int], timed: bool) -> None:
        """One budget's sample (filling it in part): its reference, the compiled eager check, its eager timing."""
        runner, adapter, clock = self.runner, self.runner.adapter, self.clock
        sample = adapter.sample_inputs(path, _fill_size(positive, budget, runner.config.path(path).unit))
        specs = item_specs(adapter, sample)
        sub = adapter.select(sample, list(range(len(specs))))
        used = sum(s.tokens[path] for s in specs)
        if not 0 < used <= budget or len(specs) > runner.limits.max_items:
            return
        tol = tolerance(runner.config.dtype, runner.device)
        parts: list[dict[str, torch.Tensor]] = []
        chunks = _parts(runner, path, sub, specs, reference_chunk(positive))
        for part in chunks:
            # The plain eager forward (what every other run is checked by), then the compiled eager forward (what
            # serves eager batches) checked against it on the same items: it engages only once checked, and stops
            # at the first disagreement. Each part's reference goes to the host before the next part runs.
            with clock("reference"):
                reference = adapter.forward_eager(path, part)
            with clock("compiled eager check"):
                runner.compiled_eager.check(adapter, path, part, reference, relative_error, tol)
            with clock("reference to host"):
                parts.append({n: t.detach().cpu() for n, t in reference.items()})
            del reference
        if timed:
            if len(chunks) > 1:  # the whole sample runs at another size than its parts
                with clock("release cached"):
                    release_cached(runner.device)
            # Timed alone (no replay exists yet to interleave with; the replay keeps the capture's own timing):
            # the minimum of spaced runs is what filters contention out (see the class).
            with clock("eager timing"):
                ms = time_host(lambda: runner.compiled_eager.forward(adapter, path, sub), TIMING_ROUNDS, runner.device)
            self.eager[path].append((used, sum(1 for s in specs if s.tokens[path]), ms))
        if self.verify:
            with clock("replay values"):
                values = {n: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                          for n, v in adapter.replay_values(path, sub, budget).items()}
            joined = parts[0] if len(parts) == 1 else {n: torch.cat([p[n] for p in parts]) for n in parts[0]}
            self.samples.append(_Sample(path, budget, values, used, joined))

    def finish(self) -> dict[str, Any]:
        """The replay phase: each kept sample's padded static forward against its reference, the attention term,
        the cost model (set as ``runner.costs``); returns the summary for ``capture_info["selfcheck"]``."""
        runner, info = self.runner, self.info
        if self.skipped:
            return info
        t0 = time.perf_counter()
        tol = tolerance(runner.config.dtype, runner.device)
        checked: dict[str, dict[int, float]] = {path: {} for path in runner.ladders}
        with peak_rise(self._device, self._memory, "selfcheck replays and costs"):
            for sample in self.samples:
                if sample.budget in runner.failed[sample.path]:
                    continue  # its capture failed, or an earlier budget's disagreement dropped the path's every one
                try:
                    with self.clock("replay check"):
                        _check_budget(runner, sample, tol, checked[sample.path])
                except Exception as exc:  # noqa: BLE001 - capture-time work never fails a call: the budget goes
                    _drop(runner, sample.path, sample.budget, f"self-check: {type(exc).__name__}: {exc}", wide=False)
            info["checked"] = checked
            if self.measure:
                with self.clock("attention term"):
                    attention = attention_terms(runner)
                with self.clock("cost fit"):
                    costs = _cost_model(runner, self.eager, {p: a for p, a in attention.items() if "coef" in a})
                if costs is not None:
                    runner.costs = costs
                    info["eager_samples"] = {p: [list(s) for s in v] for p, v in self.eager.items()}
                    info["attention"] = attention
                else:
                    info["costs"] = "greedy planner (too few eager samples)"
        self.samples = []
        info["seconds"] = round(self.seconds + time.perf_counter() - t0, 3)
        info["phase_seconds"] = self.clock.as_dict()
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


def _check_budget(runner: RunnerState, sample: _Sample, tol: float, checked: dict[int, float]) -> None:
    """One budget's padded static forward (a replay in GRAPH mode) on its sample, against the sample's reference."""
    path, budget, used, reference = sample.path, sample.budget, sample.used, sample.reference
    static = run_static(runner, path, budget, None, used, values=sample.values)
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
