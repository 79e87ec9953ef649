"""The runner's hook for the attention-kernel choice (:mod:`encgraph.models.kernel_choice`): at capture, before
any graph is captured and before the self-check and the cost model time any eager forward, the adapter chooses
its kernels (measured on this device, or taken from a given cost model), so that the graphs hold the graph kernel
chosen (torch's Flash, FlashAttention-4 or cuDNN's packed SDPA: :mod:`encgraph.models.varlen_kernel`) and the eager
times the planner compares with graph replays are those of the kernels the eager forwards will run; the
measurements then travel in the cost model's JSON and in ``capture_info["kernels"]``.

Adapters without ``choose_kernels(known)`` are left as they are (their eager forwards pass no host bounds).
"""

from __future__ import annotations

from typing import Any

import attrs

from encgraph.packing.crossover import Crossover

__all__ = ["choose_kernels", "keep_kernels"]


def choose_kernels(runner: Any) -> dict[str, Any]:
    """Let the adapter of ``runner`` (an :class:`~encgraph.EncoderGraphRunner`: its ``adapter``, ``costs`` and
    ``kernels`` are read and set) choose its eager attention kernels; returns the summary for
    ``capture_info["kernels"]`` (``{key: Crossover.to_dict()}``, empty off CUDA) and keeps the crossovers in
    ``runner.kernels`` for :func:`keep_kernels`."""
    choose = getattr(runner.adapter, "choose_kernels", None)
    if choose is None:
        return {"skipped": f"{type(runner.adapter).__name__} has no choose_kernels(known)"}
    chosen: dict[str, Crossover] = choose(runner.costs.kernels if runner.costs is not None else None)
    runner.kernels = chosen
    return {key: c.to_dict() for key, c in chosen.items()}


def keep_kernels(runner: Any) -> None:
    """Add the chosen crossovers to the runner's cost model (measured or given), if it has one."""
    chosen = getattr(runner, "kernels", None)
    if runner.costs is not None and chosen:
        runner.costs = attrs.evolve(runner.costs, kernels={**runner.costs.kernels, **chosen})
