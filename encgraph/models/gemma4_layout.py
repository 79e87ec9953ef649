"""Gemma-4's host-side patch layout: from the processor's padded ``(x, y)`` positions to packed rows in pooling-block
order, numpy only (no torch), computed once per call outside any graph.

A call's ``pixel_position_ids`` is ``(B, P, 2)``: per item (an image or a video frame) its patches' ``(x, y)``, rows
with ``(-1, -1)`` padding. The tower averages each ``k x k`` block of patches (``k`` the pooling kernel) into one
soft token, numbered ``x // k + (W // k) * (y // k)`` for a ``W x H`` grid. The packed layout puts, item after
item, soft token ``t``'s ``k^2`` patches at rows ``t * k^2 .. t * k^2 + k^2 - 1``: pooling becomes a reshape.

:func:`pack_patches` handles any row order (and checks every rule the tower relies on); :class:`PatchLayouts` adds a
fast path for the processor's own layout (each grid in row-major order, then its padding), with the per-grid
tables cached: a call of 16 processor-padded images costs one comparison pass over its positions.
:class:`Gemma4Patches` is a call's inputs with their layout.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import attrs
import numpy as np

from encgraph.errors import InputError

if TYPE_CHECKING:  # the layout is numpy only; a call's pixels are a tensor
    import torch

__all__ = ["Layout", "PatchLayouts", "Gemma4Patches", "pack_patches", "grid_positions"]

Layout = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""``(tokens (B,), source (rows,), packed_positions (rows, 2), starts (B + 1,))``, int64: soft tokens per item, the
flat row (``item * P + row``) of each packed patch, its ``(x, y)``, and each item's first packed row."""


def grid_positions(width: int, height: int) -> np.ndarray:
    """``(width * height, 2)`` int64 ``(x, y)`` in the processor's order (row-major: x fastest)."""
    ys, xs = np.meshgrid(np.arange(height, dtype=np.int64), np.arange(width, dtype=np.int64), indexing="ij")
    return np.stack([xs.ravel(), ys.ravel()], -1)


def pack_patches(positions: np.ndarray, kernel: int, table: int) -> Layout:
    """The packed layout of a call's real patches: ``(tokens, source, packed_positions, starts)``.

    ``positions``: ``(B, P, 2)`` int64 ``(x, y)`` per row, ``(-1, -1)`` for padding (the tower's rule: a row is
    padding when both are -1). Each item must hold a full ``W x H`` grid of patches (every position once),
    ``W`` and ``H`` multiples of ``kernel``, coordinates below ``table`` (the position-embedding size): what the
    processor makes and what the tower pools exactly. Soft token ``t = x // k + (W // k) * (y // k)`` (the
    tower's order) gets packed rows ``t * k^2 .. t * k^2 + k^2 - 1`` of its item. O(rows), no sort.
    """
    b, p, _ = positions.shape
    k2 = kernel * kernel
    if p % k2:
        raise InputError(
            f"pixel_position_ids: {p} patches per row is not a multiple of {k2} (pooling kernel {kernel} squared); "
            "the tower cannot pool it. Pass the processor's padded rows."
        )
    real = ~(positions == -1).all(-1)
    item, row = np.nonzero(real)
    xy = positions[item, row]
    counts = np.bincount(item, minlength=b)
    bad = np.flatnonzero(counts == 0)
    if bad.size:
        raise InputError(f"pixel_position_ids: item {int(bad[0])} has no patches (every row is (-1, -1)).")
    if (xy < 0).any() or (xy >= table).any():
        i = int(item[np.flatnonzero((xy < 0).any(1) | (xy >= table).any(1))[0]])
        raise InputError(
            f"pixel_position_ids: item {i} has a coordinate outside [0, {table}) (the position-embedding table) in "
            "a row that is not padding (-1, -1)."
        )
    starts = np.zeros(b + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    width = np.maximum.reduceat(xy[:, 0], starts[:-1]) + 1
    height = np.maximum.reduceat(xy[:, 1], starts[:-1]) + 1
    wrong = np.flatnonzero((width * height != counts) | (width % kernel != 0) | (height % kernel != 0))
    if wrong.size:
        i = int(wrong[0])
        raise InputError(
            f"pixel_position_ids: item {i} has {int(counts[i])} patches spanning {int(width[i])} x {int(height[i])}; "
            f"expected a full grid whose sides are multiples of the pooling kernel {kernel}, as the processor makes."
        )
    x, y = xy[:, 0], xy[:, 1]
    token = x // kernel + (width // kernel)[item] * (y // kernel)
    dest = starts[item] + token * k2 + (y % kernel) * kernel + x % kernel
    if np.bincount(dest, minlength=int(starts[-1])).max() > 1:
        raise InputError("pixel_position_ids: an item lists the same patch position twice.")
    source = np.empty_like(dest)
    source[dest] = item * p + row
    packed = np.empty_like(xy)
    packed[dest] = xy
    return counts // k2, source, packed, starts



class PatchLayouts:
    """:func:`pack_patches` with a fast path for the processor's layout and a bounded per-grid cache.

    The fast path holds when every item's first ``n`` rows are exactly the ``W x H`` grid in row-major order and
    the rest ``(-1, -1)`` (``W``, ``H`` read from row ``n - 1``); anything else takes :func:`pack_patches`, which
    also raises the errors. ``capacity`` bounds the cached grid shapes (a 2520-patch grid's tables are ~80 kB).
    """

    def __init__(self, kernel: int, table: int, capacity: int = 256) -> None:
        self.kernel, self.table, self.capacity = kernel, table, capacity
        self._grids: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def _grid(self, width: int, height: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(row-major positions, block-order source rows, block-order positions)`` of one grid."""
        with self._lock:
            found = self._grids.get((width, height))
            if found is None:
                if len(self._grids) >= self.capacity:
                    self._grids.clear()
                grid = grid_positions(width, height)
                _, source, packed, _ = pack_patches(grid[None], self.kernel, self.table)
                found = self._grids[(width, height)] = (grid, source, packed)
            return found

    def pack(self, positions: np.ndarray) -> Layout:
        b, p, _ = positions.shape
        k, k2 = self.kernel, self.kernel**2
        counts = (positions[:, :, 0] != -1).sum(1)
        if p % k2 or not counts.all():
            return pack_patches(positions, k, self.table)
        last = positions[np.arange(b), counts - 1]
        width, height = last[:, 0] + 1, last[:, 1] + 1
        if not ((width * height == counts) & (width % k == 0) & (height % k == 0) & (last < self.table).all(1)).all():
            return pack_patches(positions, k, self.table)
        grids = [self._grid(int(w), int(h)) for w, h in zip(width.tolist(), height.tolist())]
        expected = np.full_like(positions, -1)
        for i, (grid, _, _) in enumerate(grids):
            expected[i, : grid.shape[0]] = grid
        if not np.array_equal(positions, expected):
            return pack_patches(positions, k, self.table)
        starts = np.zeros(b + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        offsets = np.repeat(np.arange(b, dtype=np.int64) * p, counts)
        source = np.concatenate([g[1] for g in grids]) + offsets
        packed = np.concatenate([g[2] for g in grids])
        return counts // k2, source, packed, starts


@attrs.frozen(eq=False)
class Gemma4Patches:
    """The inputs of one call of the Gemma-4 adapter (:mod:`encgraph.models.gemma4`), with the layout of its real
    patches (:class:`PatchLayouts`).

    - ``pixel_values``: ``(B, P, C)`` floating point on the tower's device, as the call passed it (never copied:
      a sub-batch keeps the whole tensor and its own ``source`` rows);
    - ``positions``: ``(B, P, 2)`` int64 host copy of ``pixel_position_ids``;
    - ``tokens``: ``(n,)`` soft tokens per item; ``video``: ``(n,)`` bool, the item runs on the video path;
    - ``source``: ``(rows,)`` flat row index into ``pixel_values.view(B * P, C)`` of each packed patch, items in
      order, each in pooling-block order; ``packed_positions``: ``(rows, 2)`` their ``(x, y)``;
    - ``starts``: ``(n + 1,)`` first packed row of each item, then the total;
    - ``return_dict``: the caller's (``False``: ``output_for_call`` returns a tuple).
    """

    pixel_values: torch.Tensor
    positions: np.ndarray
    tokens: np.ndarray
    video: np.ndarray
    source: np.ndarray
    packed_positions: np.ndarray
    starts: np.ndarray
    return_dict: bool = True

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    def rows_of(self, items: np.ndarray) -> np.ndarray:
        """Packed row indices of ``items`` (positions in this object), in order."""
        sizes = self.starts[items + 1] - self.starts[items]
        first = np.repeat(self.starts[items] - np.cumsum(sizes) + sizes, sizes)
        return first + np.arange(first.shape[0])
