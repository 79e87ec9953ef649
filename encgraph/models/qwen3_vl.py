"""The Qwen3-VL vision tower (``Qwen3VLVisionModel``, config ``Qwen3VLVisionConfig``; the identical
``Qwen3VLMoeVisionModel`` of Qwen3-VL-MoE too).

Besides the 2-D rotary positions, each patch gets a learned position embedding resampled (bilinear,
``align_corners=True``) from a square ``num_grid_per_side^2`` table to the item's grid: encgraph computes the
4 gather indices and weights per patch row on the host (``interp_indices`` / ``interp_weights``, exactly as
``transformers.vision_utils.get_vision_interpolation_indices_and_weights``, in float32). The features after
the layers in ``deepstack_visual_indexes`` pass through their own mergers and come out as extra named outputs
``deepstack_0``, ``deepstack_1``, ... (one token per row, like ``pooler_output``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from encgraph.errors import ConfigError
from encgraph.models.protocol import BufferSpec, FillRule
from encgraph.models.qwen_grid import UnitGrid, patch_coords, unit_grid
from encgraph.models.qwen_vl import QwenVisionAdapter

__all__ = ["InterpolatedPositions", "Qwen3VLAdapter", "adapter", "interpolation"]

TAPS = 4  # bilinear: 2 per axis


def _axis(index: np.ndarray, size: np.ndarray, side: int, align_corners: bool = True) -> tuple[np.ndarray, ...]:
    """Bilinear taps along one axis: ``(tap0, tap1, weight0, weight1)``, each shaped like ``index``; the
    ``align_corners=False`` sampling takes half-pixel centres, taps past an edge clamped to it (``F.interpolate``'s
    border). The same float32 operations, in the same order, as transformers' helper, so that the weights match it
    bit for bit."""
    if align_corners:
        src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    else:
        src = (index.astype(np.float32) + np.float32(0.5)) * np.float32(side) / size.astype(np.float32) - np.float32(0.5)
    floor = np.floor(src)
    low = floor.astype(np.int64)
    frac = src - floor
    one = np.float32(1)
    # Hat kernel max(1 - |src - tap|, 0) at tap = floor and floor + 1; taps clamped to the table.
    return (
        np.clip(low, 0, side - 1),
        np.clip(low + 1, 0, side - 1),
        np.maximum(one - np.abs(frac), np.float32(0)),
        np.maximum(one - np.abs(frac - one), np.float32(0)),
    )


def _axis_tables(lengths: np.ndarray, side: int, align_corners: bool) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """:func:`_axis` of every position ``0..L-1`` of each axis length ``L``, concatenated, and the offset of each
    length's first position: the interpolation is separable, so patch rows need only gathers from these."""
    first = np.zeros(lengths.shape[0], dtype=np.int64)
    np.cumsum(lengths[:-1], out=first[1:])
    owner = np.repeat(np.arange(lengths.shape[0]), lengths)
    return _axis(np.arange(owner.shape[0]) - first[owner], lengths[owner], side, align_corners), first


def interpolation(units: UnitGrid, side: int, align_corners: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Per patch row, the ``TAPS`` rows of the flattened ``side x side`` position table and their bilinear
    weights: ``(rows, 4)`` int64 and ``(rows, 4)`` float32 (taps ordered (h0, w0), (h0, w1), (h1, w0), (h1, w1))."""
    m = units.merge
    row, col = patch_coords(units)
    frame = np.repeat(units.frame, m * m)
    h_axis, h_first = _axis_tables(units.height * m, side, align_corners)
    w_axis, w_first = _axis_tables(units.width * m, side, align_corners)
    h0, h1, hw0, hw1 = (a.take(h_first[frame] + row) for a in h_axis)
    w0, w1, ww0, ww1 = (a.take(w_first[frame] + col) for a in w_axis)
    h0, h1 = h0 * side, h1 * side
    indices = np.stack((h0 + w0, h0 + w1, h1 + w0, h1 + w1), axis=1)
    weights = np.stack((hw0 * ww0, hw0 * ww1, hw1 * ww0, hw1 * ww1), axis=1)
    return indices, weights


class InterpolatedPositions:
    """The families whose learned square position table is resampled to each frame's grid (bilinear taps computed
    on the host): Qwen3-VL and PaddleOCR-VL. Buffers per budget (``R`` patch rows): ``interp_indices`` ``(R, 4)``
    int64 and ``interp_weights`` ``(R, 4)`` float32, both ZERO (padding rows get a zero position embedding),
    passed to the tower as its keyword arguments of those names. Reads the adapter's ``grid_side``, ``merge``,
    ``align_corners`` and ``_rows``."""

    grid_side: int
    merge: int
    align_corners: bool = True
    raster_rows: bool = False
    """Patch rows come in raster order within a frame although the tower merges (HunYuan-VL, whose merger takes
    ``merge x merge`` blocks itself), not in merge-block order; a tower of merge 1 (PaddleOCR-VL) is raster
    either way."""

    def _extra_buffer_specs(self, budget: int, max_frames: int) -> dict[str, BufferSpec]:
        rows = self._rows(budget)  # type: ignore[attr-defined]
        return {
            "interp_indices": BufferSpec((rows, TAPS), torch.int64, FillRule.ZERO),
            "interp_weights": BufferSpec((rows, TAPS), torch.float32, FillRule.ZERO),
        }

    def _frame_tables(self, units: UnitGrid) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        rows = units.height * units.width * self.merge**2
        if self.raster_rows and units.merge > 1:  # the same frames in patches: patch_coords then is raster order
            units = unit_grid(np.stack((np.ones_like(rows), units.height * units.merge, units.width * units.merge), 1), 1)
        indices, weights = interpolation(units, self.grid_side, self.align_corners)
        return {"interp_indices": (indices, rows), "interp_weights": (weights, rows)}

    def _assemble(self, frames: list[dict[str, np.ndarray]], cu: np.ndarray) -> dict[str, np.ndarray]:
        return {name: np.concatenate([f[name] for f in frames]) for name in ("interp_indices", "interp_weights")}

    def _static_kwargs(self, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, Any]:
        return {"interp_indices": buffers["interp_indices"], "interp_weights": buffers["interp_weights"]}


class Qwen3VLAdapter(InterpolatedPositions, QwenVisionAdapter):
    """Adapter of a Qwen3-VL vision tower; see :class:`~encgraph.models.qwen_vl.QwenVisionAdapter`.

    Extra buffers per budget (``R`` patch rows): ``interp_indices`` ``(R, 4)`` int64 and ``interp_weights``
    ``(R, 4)`` float32, both ZERO (padding rows get a zero position embedding). Extra outputs: ``deepstack_i``.
    """

    family = "Qwen3-VL"
    tower_class = "Qwen3VLVisionModel"

    def _init_family(self, module: torch.nn.Module) -> None:
        mode = getattr(module, "interpolation_mode", "bilinear")
        corners = getattr(module, "interpolation_align_corners", True)
        if mode != "bilinear" or corners is not True:
            raise ConfigError(
                f"module: the {self.family} adapter reproduces bilinear interpolation with align_corners=True, the "
                f"tower uses {mode!r} with align_corners={corners!r}."
            )
        self.grid_side = int(module.num_grid_per_side)
        self.deepstack = len(getattr(module, "deepstack_visual_indexes", ()))  # Qwen3.5's tower has none
        tower_module = importlib.import_module(type(module).__module__)
        self._output_class = getattr(tower_module, "BaseModelOutputWithDeepstackFeatures", None)
        if self._output_class is None:
            from transformers.models.qwen3_vl.modeling_qwen3_vl import (
                BaseModelOutputWithDeepstackFeatures,
            )

            self._output_class = BaseModelOutputWithDeepstackFeatures

    def _extra_outputs(self) -> tuple[str, ...]:
        return tuple(f"deepstack_{i}" for i in range(self.deepstack))

    def _extra_named(self, out: Any) -> dict[str, torch.Tensor]:
        return {f"deepstack_{i}": feature for i, feature in enumerate(out.deepstack_features)}

    def _output(self, last: torch.Tensor | None, cat: dict[str, torch.Tensor]) -> Any:
        """``BaseModelOutputWithDeepstackFeatures``: ``pooler_output`` and ``deepstack_features`` (a list,
        one ``(tokens, out_hidden)`` tensor per deepstack layer), as the tower returns them."""
        deepstack = [cat[name] for name in self._extra_outputs()]
        return self._output_class(
            last_hidden_state=last, pooler_output=cat["pooler_output"], deepstack_features=deepstack
        )


def adapter(module: torch.nn.Module, **options: Any) -> Qwen3VLAdapter:
    """The registry factory: ``options`` are :class:`Qwen3VLAdapter`'s keyword arguments."""
    return Qwen3VLAdapter(module, **options)
