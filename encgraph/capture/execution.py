"""Running one sub-batch at one budget: the adapter's item specs, the static forward (a graph replay in GRAPH
mode) over the budget's filled buffers, the check of what a forward returned, and its split into per-item results.

The runner (:mod:`encgraph.capture.runner`), the capture (:mod:`encgraph.capture.capture`) and the self-check
(:mod:`encgraph.capture.selfcheck`) all run budgets this way; they share the runner's state through
:class:`RunnerState`, the part of it they read and fill.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from encgraph._validate import describe
from encgraph.capture.buffers import PathBuffers, PathOutputs
from encgraph.capture.compiled_eager import CompiledEager
from encgraph.capture.compiling import CompileMode
from encgraph.capture.feedback import holding_budget, predicted_ms
from encgraph.capture.protocol import AdapterConfig, EncoderAdapter
from encgraph.capture.records import GraphRecord, RunMode
from encgraph.errors import ConfigError, InputError
from encgraph.packing import Batch, CostModel, EagerReason, ItemSpec, Limits

__all__ = ["RunnerState", "item_specs", "route", "run_static", "split_outputs", "check_outputs", "CAPTURE_FAILED",
           "EAGER_MODE"]

CAPTURE_FAILED = "capture failed at that budget"
EAGER_MODE = "runner in eager mode"


class RunnerState(Protocol):
    """What capture, the self-check and :func:`run_static` read of a runner (an
    :class:`~encgraph.EncoderGraphRunner`), and fill: ``records``, ``failed`` and ``outputs`` at capture,
    ``costs`` when the self-check measures a cost model, ``compiled_eager`` at capture (the blocks compiled for capture,
    kept for eager forwards: :mod:`encgraph.capture.compiled_eager`)."""

    adapter: EncoderAdapter
    config: AdapterConfig
    device: torch.device
    mode: RunMode
    ladders: dict[str, tuple[int, ...]]
    limits: Limits
    buffers: dict[str, PathBuffers]
    outputs: dict[str, PathOutputs]
    records: dict[str, dict[int, GraphRecord]]
    failed: dict[str, dict[int, str]]
    copy_outputs: bool
    warmup: int
    progress: bool
    compile_mode: CompileMode
    cache_dir: str | os.PathLike[str] | None
    costs: CostModel | None
    compiled_eager: CompiledEager

    @property
    def planning_ladders(self) -> dict[str, tuple[int, ...]]: ...


def item_specs(adapter: EncoderAdapter, inputs: Any) -> list[ItemSpec]:
    """The adapter's specs of ``inputs`` (its validation included); an empty batch is an input error."""
    specs = adapter.item_specs(inputs)
    if not specs:
        raise InputError("inputs: expected at least one item, got an empty batch.")
    return specs


def route(state: RunnerState, feedback: Any, batch: Batch, path: str, specs: Sequence[ItemSpec]
          ) -> tuple[int | None, str | None]:
    """How ``path`` of a planned ``batch`` (items ``specs``) runs: ``(budget, None)`` to replay ``budget`` (the
    static forward outside GRAPH mode), or ``(budget or None, reason)`` to run eagerly, ``reason`` counted in
    ``stats["eager_reasons"]``. A batch the cost model sends eagerly as cheaper replays instead where its eager
    run would lose more than that to rent (the adapter's optional ``eager_surcharge_ms(path, specs)``: dense
    attention plans not bought yet, see :class:`~encgraph.packing.kernels.PlanLedger`), and the adapter's
    ``rent_replayed(path, specs)`` records the rent; and now and then anyway (``feedback``, a
    :class:`~encgraph.capture.feedback.CostFeedback`: the model may be wrong)."""
    budget = batch.budgets[path]
    if state.mode is RunMode.EAGER:
        return budget, EAGER_MODE
    if budget is None:
        if batch.eager[path] is EagerReason.COST:
            usable = [b for b in state.planning_ladders[path] if state.mode is not RunMode.GRAPH or b in state.records[path]]
            surcharge = getattr(state.adapter, "eager_surcharge_ms", None)
            rent = getattr(state.adapter, "rent_replayed", None)
            if surcharge is not None and rent is not None:
                rerouted = feedback.reroute(state.costs, path, usable, specs, state.limits, surcharge(path, specs))
                if rerouted is not None:
                    # A split replay rents (or buys) lengths of its own (DenseRule.replayed): no eager rent is paid.
                    if not _splits(state, path, rerouted, specs):
                        rent(path, specs)  # the lengths pay their rent: each is bought once it pays the plan
                    return rerouted, None
            split = _piecewise_budget(state, path, usable, specs)
            if split is not None:
                return split, None
            explored = feedback.explore(path, usable, specs, state.limits)
            if explored is not None:
                return explored, None
        return None, batch.eager[path].value
    if state.mode is RunMode.GRAPH and budget not in state.records[path]:
        return budget, CAPTURE_FAILED
    return budget, None


def _piecewise_budget(state: RunnerState, path: str, usable: Sequence[int], specs: Sequence[ItemSpec]) -> int | None:
    """The budget to replay a batch the cost model sends eagerly where its piecewise replay there
    (:mod:`encgraph.capture.piecewise`) is predicted cheaper than the eager run, both at their steady kernels: the
    whole graph's price less what its long sequences save on the dense kernel, plus the split's measured cost.
    Needs the adapter's ``attention_rows(path, specs)`` (each full-attention sequence's rows); else ``None``."""
    if state.mode is not RunMode.GRAPH or state.costs is None:
        return None
    budget = holding_budget(path, usable, specs, state.limits)
    gain = _split_gain(state, path, budget, specs) if budget is not None else None
    if gain is None:
        return None
    pieces = state.records[path][budget].piecewise
    whole = predicted_ms(state.costs, path, budget, specs)
    return budget if whole - gain + pieces.overhead_ms < predicted_ms(state.costs, path, None, specs) else None


def _split_gain(state: RunnerState, path: str, budget: int, specs: Sequence[ItemSpec]) -> float | None:
    """What the piecewise replay of ``budget`` would save on items ``specs`` (each full-attention sequence's rows
    from the adapter's ``attention_rows``), where it would pay (more than its overhead); else ``None``."""
    rows_of = getattr(state.adapter, "attention_rows", None)
    pieces = getattr(state.records[path].get(budget), "piecewise", None)
    if pieces is None or rows_of is None:
        return None
    bounds = tuple(int(x) for x in np.concatenate([[0], np.cumsum(rows_of(path, specs), dtype=np.int64)]))
    gain = pieces.gain_ms([bounds] * len(pieces.sites))
    return gain if gain > pieces.overhead_ms else None


def _splits(state: RunnerState, path: str, budget: int, specs: Sequence[ItemSpec]) -> bool:
    """Whether a replay of ``specs`` at ``budget`` would run piecewise (as :func:`run_static` decides)."""
    return _split_gain(state, path, budget, specs) is not None


def run_static(
    state: RunnerState, path: str, budget: int, sub: Any, used: int, *, last_on_path: bool = True,
    piecewise: bool | None = None, on_piecewise: Callable[[], None] | None = None,
    values: Mapping[str, Any] | None = None,
) -> Mapping[str, torch.Tensor]:
    """Fill ``path``'s buffers of ``budget`` with the sub-batch ``sub`` and run its static forward (GRAPH mode:
    replay the captured graph); return the first ``used`` rows of each output. In GRAPH mode they are fresh
    tensors when ``state.copy_outputs``, else views of the path's shared output buffers, overwritten by the next
    replay of that path. ``last_on_path=False`` (a later sub-batch of the same call may replay this path) copies
    them even then: every budget of a path shares one output buffer, and a zero-copy result must stay valid
    until the next call, not only until the next sub-batch. An adapter whose ``assemble`` copies each item
    (``assemble_copies``, see :mod:`encgraph.capture.protocol`) always gets the views: its copy, made before the
    next replay, is the only one.

    In GRAPH mode a budget captured piecewise too (:mod:`encgraph.capture.piecewise`) replays that way where its
    long sequences' attention saves more than the split costs (``piecewise=None``), always (``True``: the
    self-check) or never (``False``); ``on_piecewise`` is called when it did.

    ``values``: the adapter's ``replay_values`` of ``sub`` at ``budget``, computed already (the self-check's, kept
    on the host from before the capture; ``sub`` is then unused)."""
    if values is None:
        values = state.adapter.replay_values(path, sub, budget)
    views = state.buffers[path].fill(budget, values)
    if state.mode is RunMode.GRAPH:
        record = state.records[path][budget]
        pieces = record.piecewise if piecewise is not False else None
        bounds = pieces.site_bounds(state.buffers[path].host_bounds) if pieces is not None else None
        if pieces is not None and (piecewise or pieces.pays(bounds)):
            pieces.replay(bounds)
            if on_piecewise is not None:
                on_piecewise()
        else:
            record.graph.replay()
        outputs = record.outputs  # views of the path's shared output buffers
        if (state.copy_outputs or not last_on_path) and getattr(state.adapter, "assemble_copies", False) is not True:
            return {name: t[:used].clone() for name, t in outputs.items()}
        return {name: t[:used] for name, t in outputs.items()}
    outputs = state.adapter.forward_static(path, views, budget)
    check_outputs(state.adapter, path, budget, outputs, budget, "static")
    return {name: t[:used] for name, t in outputs.items()}


def split_outputs(
    adapter: EncoderAdapter, outputs: Mapping[str, Mapping[str, torch.Tensor]], specs: Sequence[ItemSpec]
) -> list[Any]:
    """A sub-batch's outputs (per path, per output name: the items' rows one after the other, in ``specs``'
    order) cut into each item's rows and assembled by the adapter into its per-item results."""
    offsets = dict.fromkeys(outputs, 0)
    results = []
    for spec in specs:
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for path, named in outputs.items():
            n = spec.tokens[path]
            if n:
                o = offsets[path]
                parts[path] = {name: t[o : o + n] for name, t in named.items()}
                offsets[path] = o + n
        results.append(adapter.assemble(parts))
    return results


def check_outputs(
    adapter: EncoderAdapter, path: str, budget: int | None, outputs: Any, rows: int, kind: str
) -> None:
    """Raise a :class:`~encgraph.ConfigError` unless ``outputs`` (of ``forward_{kind}``) maps exactly the path's
    output names to tensors of ``rows`` rows in dim 0."""
    # Read the adapter's config afresh: a generic adapter learns its output names on its first call.
    expected = adapter.config.path(path).outputs
    if not isinstance(outputs, Mapping) or tuple(sorted(outputs)) != tuple(sorted(expected)):
        raise ConfigError(
            f"forward_{kind}({path!r}): expected a mapping with outputs {list(expected)}, got "
            f"{describe(outputs) if not isinstance(outputs, Mapping) else sorted(outputs)}."
        )
    for name, t in outputs.items():
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != rows:
            raise ConfigError(
                f"forward_{kind}({path!r}) at budget {budget}: output {name!r} must have {rows} rows in dim 0, "
                f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else describe(t)}."
            )
