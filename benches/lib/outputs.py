"""Comparing outputs: every tensor of a result, and the largest relative difference between two results."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def flatten_tensors(value: Any) -> list[Any]:
    """Every tensor in a result (tensor, mapping, ModelOutput, tuple or list), in a stable order."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for k in sorted(value) for t in flatten_tensors(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flatten_tensors(v)]
    return []


def max_rel_diff(results: Sequence[Any], reference: Sequence[Any]) -> float:
    """``max |a - b| / max |b|`` over every tensor of every item (fp32); ``inf`` when the layouts differ."""
    worst = 0.0
    if len(results) != len(reference):
        return math.inf
    for a_item, b_item in zip(results, reference):
        a_list, b_list = flatten_tensors(a_item), flatten_tensors(b_item)
        if len(a_list) != len(b_list):
            return math.inf
        for a, b in zip(a_list, b_list):
            if a.shape != b.shape:
                return math.inf
            b32 = b.float()
            scale = float(b32.abs().max()) if b32.numel() else 0.0
            diff = float((a.float() - b32).abs().max()) if b32.numel() else 0.0
            worst = max(worst, diff / scale if scale else diff)
    return worst


def without_padding_rows(value: Any, mask: Any) -> Any:
    """``value`` with every tensor laid out ``(images, rows, ...)`` like ``mask`` ``(images, rows)`` zeroed where
    the mask is 0 (a copy; other tensors as they are): what a padded call's outputs are compared on where the
    padding rows are not data (SigLIP2 NaFlex: encgraph writes zeros there, the tower what its attention makes of
    padding queries; docs in ``encgraph/models/siglip2.py``)."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and tuple(value.shape[:2]) == tuple(mask.shape):
            keep = mask.to(value.device).bool().reshape(*mask.shape, *([1] * (value.dim() - 2)))
            return torch.where(keep, value, torch.zeros((), dtype=value.dtype, device=value.device))
        return value
    if isinstance(value, Mapping):
        return {k: without_padding_rows(v, mask) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_padding_rows(v, mask) for v in value]
    return value
