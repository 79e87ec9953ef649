"""Running one sub-batch at one budget: the adapter's item specs, the static forward (a graph replay in GRAPH
mode) over the budget's filled buffers, the check of what a forward returned, and its split into per-item results.

The runner (:mod:`encgraph.capture.runner`), the capture (:mod:`encgraph.capture.capture`) and the self-check
(:mod:`encgraph.capture.selfcheck`) all run budgets this way; they share the runner's state through
:class:`RunnerState`, the part of it they read and fill.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from encgraph._validate import describe
from encgraph.capture.buffers import PathBuffers, PathOutputs
from encgraph.capture.compiled_eager import CompiledEager
from encgraph.capture.compiling import CompileMode
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
    ``stats["eager_reasons"]``. A batch the cost model sends eagerly as cheaper replays now and then anyway
    (``feedback``, a :class:`~encgraph.capture.feedback.CostFeedback`: the model may be wrong)."""
    budget = batch.budgets[path]
    if state.mode is RunMode.EAGER:
        return budget, EAGER_MODE
    if budget is None:
        if batch.eager[path] is EagerReason.COST:
            usable = [b for b in state.planning_ladders[path] if state.mode is not RunMode.GRAPH or b in state.records[path]]
            explored = feedback.explore(path, usable, specs, state.limits)
            if explored is not None:
                return explored, None
        return None, batch.eager[path].value
    if state.mode is RunMode.GRAPH and budget not in state.records[path]:
        return budget, CAPTURE_FAILED
    return budget, None


def run_static(
    state: RunnerState, path: str, budget: int, sub: Any, used: int, *, last_on_path: bool = True,
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

    ``values``: the adapter's ``replay_values`` of ``sub`` at ``budget``, computed already (the self-check's, kept
    on the host from before the capture; ``sub`` is then unused)."""
    if values is None:
        values = state.adapter.replay_values(path, sub, budget)
    views = state.buffers[path].fill(budget, values)
    if state.mode is RunMode.GRAPH:
        record = state.records[path][budget]
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
