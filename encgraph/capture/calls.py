"""One call of a runner (:class:`~encgraph.EncoderGraphRunner`, phase 3 of :mod:`encgraph.capture.runner`): item
specs -> ``pack`` -> per planned sub-batch, every path routed to its budget's static forward (a replay in GRAPH
mode) or to the eager forward, timed for the cost model's check while serving and counted -> per-item results in
the caller's order.

The runner owns the state (lock, buffers, cost model, counters); these functions run a call over it, as
:mod:`encgraph.capture.relayout` replaces its ladder.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from encgraph.capture.execution import check_outputs, item_specs, route, run_static, split_outputs
from encgraph.capture.records import RunMode
from encgraph.errors import CaptureError
from encgraph.packing import Batch, EagerReason, ItemSpec, Plan

__all__ = ["call", "call_rows", "run_batch"]

log = logging.getLogger("encgraph")
T = TypeVar("T")


def call(runner: Any, inputs: Any) -> list[Any]:
    """``runner(inputs)`` on this process (no data-parallel split): one result per item, in the caller's order."""
    with _calling(runner):
        # Each sub-batch is cut into its items right after it ran: an adapter whose assemble copies each item
        # (assemble_copies) gets views of the output buffers, which the next sub-batch's replay overwrites.
        def items(specs: list[ItemSpec], batch: Batch, out: Mapping[str, Mapping[str, torch.Tensor]]) -> list[Any]:
            return split_outputs(runner.adapter, out, [specs[i] for i in batch.items])

        _specs, plan, results = _execute(runner, inputs, items)
        return plan.restore(results)


def call_rows(runner: Any, inputs: Any) -> dict[str, torch.Tensor] | None:
    """``runner.call_rows(inputs)``: for a one-path runner whose every item is one row of every output (a batch
    ladder), each output over the call's items in the caller's order, without cutting it into per-item results
    and joining them again (one copy, none where one sub-batch ran). ``None`` where that does not hold: call the
    runner instead."""
    (path, *more) = runner.config.path_names
    if more:
        return None
    if getattr(runner.adapter, "assemble_copies", False) is True:
        return None  # its outputs are views until its own per-item copy
    with _calling(runner):
        specs = item_specs(runner.adapter, inputs)
        if any(s.tokens[path] != 1 for s in specs):
            return None  # not one row an item: nothing ran
        specs, plan, outputs = _execute(runner, inputs, lambda _s, _b, out: out, specs)
        order = [i for batch in plan.batches for i in batch.items]
        parts = [out[path] for out in outputs]
        joined = {name: parts[0][name] if len(parts) == 1 else torch.cat([p[name] for p in parts])
                  for name in parts[0]}
        if order != list(range(len(order))):
            where = torch.empty(len(order), dtype=torch.long)
            where[torch.tensor(order)] = torch.arange(len(order))
            joined = {name: t.index_select(0, where.to(t.device)) for name, t in joined.items()}
        # One sub-batch: its outputs as run_batch gave them (fresh unless copy_outputs=False: then views valid
        # until the next call, as the runner's own results are).
        return joined


@contextlib.contextmanager
def _calling(runner: Any) -> Iterator[None]:
    with runner._lock, torch.no_grad():
        yield


def _execute(runner: Any, inputs: Any, finish: Callable[[list[ItemSpec], Batch, Any], T],
             specs: list[ItemSpec] | None = None) -> tuple[list[ItemSpec], Plan, list[T]]:
    """Plan the call and run its sub-batches: the item specs (``specs``, where the caller has them), the plan,
    and per sub-batch ``finish(specs, batch, outputs)``, called right after it ran (``outputs``: per path, the
    sub-batch's items' rows one after the other, in its order)."""
    if specs is None:
        specs = item_specs(runner.adapter, inputs)
    if not runner.captured:
        if runner.mode is RunMode.GRAPH and not runner.lazy:
            raise CaptureError("runner: call capture() before the first call, or pass lazy=True.")
        runner.capture()
    if runner._record:
        runner.observed.append(tuple(specs))
    # Read what earlier calls timed (never waits) and correct the model: a correction is no replacement
    # (the feedback goes on; the setter would reset it).
    if runner._costs is not None:
        runner._costs = runner._feedback.poll(runner._costs) or runner._costs
    plan = runner._pack(specs)
    # Per path, the last sub-batch with tokens there: only its zero-copy results may stay views.
    last = {p: max((i for i, b in enumerate(plan.batches) if b.tokens[p]), default=-1)
            for p in runner.config.path_names}
    outputs = [finish(specs, batch, run_batch(runner, inputs, specs, batch, {p for p, j in last.items() if j == i}))
               for i, batch in enumerate(plan.batches)]
    runner._stats.add_call()
    if log.isEnabledFor(logging.DEBUG):
        log.debug("encgraph: call of %d items, %d batches; stats %s", len(specs), len(plan.batches), runner.stats)
    return specs, plan, outputs


def run_batch(
    runner: Any, inputs: Any, specs: Sequence[ItemSpec], batch: Batch, last_on: set[str]
) -> dict[str, Mapping[str, torch.Tensor]]:
    """The outputs of one planned sub-batch, per path: each path with tokens runs at its budget, or eagerly where
    the plan or the route says so (``last_on``: the paths whose last sub-batch of the call this is, whose
    zero-copy results may stay views of the output buffers)."""
    sub = runner.adapter.select(inputs, batch.items)
    sub_specs = [specs[i] for i in batch.items]
    outputs: dict[str, Mapping[str, torch.Tensor]] = {}
    eager_paths: dict[str, str] = {}
    stats, feedback = runner._stats, runner._feedback
    for path in runner.config.path_names:
        budget = batch.budgets[path]
        used = batch.tokens[path]
        if budget == 0 or used == 0:
            continue
        budget, reason = route(runner, feedback, batch, path, sub_specs)
        # Forced eager runs (over the ladder, over max_frames) lie where the model is extrapolated: not checked.
        chosen = reason is None or reason == EagerReason.COST.value
        with feedback.timed(runner.costs, path, None if reason else budget, sub_specs, chosen=chosen):
            if reason is not None:
                out = runner.compiled_eager.forward(runner.adapter, path, sub)
                check_outputs(runner.adapter, path, budget, out, used, "eager")
                eager_paths[path] = reason
                stats.add_eager(path, reason, sum(1 for s in sub_specs if s.tokens[path]), used)
            else:
                out = run_static(runner, path, budget, sub, used, last_on_path=path in last_on)
                stats.add_replay(path, budget, used)
        outputs[path] = out
    stats.add_items(eager=sum(1 for s in sub_specs if any(s.tokens[p] for p in eager_paths)), total=len(sub_specs))
    return outputs
