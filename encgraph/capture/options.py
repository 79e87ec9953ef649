"""The runner's options resolved against its adapter: ladders, per-batch limits and device (no device work)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from encgraph._validate import check_int, describe
from encgraph.capture.protocol import AdapterConfig, BudgetUnit
from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing import Limits, default_limits, dense_ladder, normalize_ladders

__all__ = ["TOKEN_RATIO", "ITEM_RATIO", "resolve_ladders", "resolve_limits", "resolve_device", "check_bool"]

TOKEN_RATIO = 1.2
"""Default ladder spacing of token paths: a single item pads by at most ~20%, ~9% on average (log-uniform
sizes), which the cost-aware planner then trims further by packing items together."""
ITEM_RATIO = 1.25
"""Default ladder spacing of item paths (batch sizes 1, 2, 3, 4, 5, 6, 8, 10, ...)."""


def resolve_ladders(config: AdapterConfig, budgets: Any) -> dict[str, tuple[int, ...]]:
    """Per path, the ladder of ``budgets`` (one ladder, or ``{path: ladder}`` for a multi-path adapter; ``None``:
    :func:`~encgraph.packing.dense_ladder` from the path's bounds), with budget 0 on paths that may be empty."""
    paths = config.paths
    if budgets is None:
        return {
            p.name: dense_ladder(
                p.min_budget, p.max_budget, allow_zero=p.allow_empty,
                ratio=ITEM_RATIO if p.unit is BudgetUnit.ITEMS else TOKEN_RATIO,
            )
            for p in paths
        }
    if not isinstance(budgets, Mapping) and len(paths) > 1:
        raise ConfigError(
            f"budgets: this adapter has paths {list(config.path_names)}; give {{path: ladder}}, got "
            f"{describe(budgets)}."
        )
    if not isinstance(budgets, Mapping):
        budgets = {paths[0].name: budgets}
    ladders = normalize_ladders(budgets, paths=config.path_names)
    for p in paths:
        if 0 in ladders[p.name] and not p.allow_empty:
            raise ConfigError(f"budgets[{p.name!r}]: 0 is allowed only on a path that may be empty; drop it.")
        if p.allow_empty and 0 not in ladders[p.name]:
            ladders[p.name] = (0, *ladders[p.name])
    return ladders


def resolve_limits(
    config: AdapterConfig, ladders: Mapping[str, tuple[int, ...]], max_items: int | None, max_frames: int | None
) -> Limits:
    """The per-batch limits: :func:`~encgraph.packing.default_limits` for token budgets; for paths whose budgets
    count items, at most the largest batch size captured."""
    if not all(p.unit is BudgetUnit.ITEMS for p in config.paths):
        return default_limits(
            ladders, max_frames_per_item=config.max_frames_per_item, max_items=max_items, max_frames=max_frames
        )
    # Budgets count items: every item fills one unit, so the cap on items is the largest batch size, and the
    # token rule of default_limits (items <= smallest budget) does not apply.
    largest = min(max(ladders[p.name]) for p in config.paths)
    items = largest if max_items is None else check_int("max_items", max_items, minimum=1)
    if items > largest:
        raise ConfigError(f"max_items: expected at most {largest} (the largest batch size captured), got {items}.")
    frames = items * config.max_frames_per_item if max_frames is None else check_int("max_frames", max_frames, minimum=1)
    return Limits(max_items=items, max_frames=frames)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigTypeError(f"{name}: expected True or False, got {describe(value)}.")
    return value


def resolve_device(device: torch.device | str | None, tower: torch.device) -> torch.device:
    if device is None:
        resolved = tower
    else:
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigTypeError(f"device: expected a torch.device or a string like 'cuda:0', got {describe(device)}.") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device: {resolved} was asked for but CUDA is not available; use device='cpu'.")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    tower_norm = tower
    if tower.type == "cuda" and tower.index is None and torch.cuda.is_available():
        tower_norm = torch.device("cuda", torch.cuda.current_device())
    if resolved != tower_norm:
        raise ConfigError(
            f"device: the tower's weights are on {tower}, but device={resolved} was asked for; move the module "
            f"first (module.to({str(resolved)!r})) or leave device unset."
        )
    return resolved
