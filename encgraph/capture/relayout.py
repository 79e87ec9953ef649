"""Replacing a runner's ladder: :func:`tune` proposes one from recorded calls, :func:`reset_ladders` takes a new
one and drops what the old one captured (``EncoderGraphRunner.recapture`` then captures again)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from encgraph.capture.buffers import PathOutputs
from encgraph.capture.options import resolve_ladders, resolve_limits
from encgraph.errors import ConfigError, EncgraphError
from encgraph.packing import TunedLadder, tune_ladder

__all__ = ["reset_ladders", "tune"]

log = logging.getLogger("encgraph")


def tune(runner: Any, *, max_budgets: int, memory_cap_tokens: int | None, granularity: int) -> TunedLadder:
    """``runner.tune(...)``: the least-cost ladder for the calls ``runner`` recorded (``record=N``)."""
    if not runner.observed:
        raise ConfigError("tune: no calls recorded; construct the runner with record=N and serve traffic first.")
    return tune_ladder(
        list(runner.observed), max_budgets=max_budgets, max_items=runner.limits.max_items,
        memory_cap_tokens=memory_cap_tokens, costs=runner.costs, granularity=granularity, baseline=runner.ladders,
    )


def reset_ladders(runner: Any, budgets: Any, max_items: int | None, max_frames: int | None) -> None:
    """Take the ladders of ``budgets`` and the new limits (the old ones kept if either is refused), and drop every
    graph, buffer, output buffer, the memory pool and the cost model (its budgets are gone); the caller holds the
    runner's lock and captures next."""
    ladders = resolve_ladders(runner.config, budgets)
    old = (runner.ladders, runner.limits)
    runner.ladders = ladders
    try:
        runner.limits = resolve_limits(runner.config, runner.ladders, max_items, max_frames)
    except EncgraphError:
        runner.ladders, runner.limits = old
        raise
    runner.records = {p: {} for p in runner.config.path_names}
    runner.failed = {p: {} for p in runner.config.path_names}
    runner.buffers = {}
    runner.outputs = {p: PathOutputs(p, runner.device) for p in runner.config.path_names}
    runner._pool = None
    if runner.costs is not None and not runner._measure_costs:
        log.info("encgraph: recapture drops the cost model (its budgets are gone); planning greedily until "
                 "measure_costs() is called again.")
    runner.costs = None
    runner.captured = False
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
