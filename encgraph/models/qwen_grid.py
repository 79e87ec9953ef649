"""Host-side geometry of the packed-grid towers (the Qwen-VL pattern, :mod:`encgraph.models.qwen_vl`): items'
grids in output-token units, frame bounds, patch coordinates, rotary and raster positions, the per-frame-shape
table cache, and the checks of the per-item grid and window arguments. numpy on the host; nothing here touches a
device tensor except :func:`grid_array`'s one copy of a ``grid_thw`` tensor to the host.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch

from encgraph._validate import describe
from encgraph.errors import ConfigError, InputError, InputTypeError

__all__ = [
    "FrameTableCache",
    "UnitGrid",
    "check_window",
    "frame_bounds",
    "grid_array",
    "patch_coords",
    "raster_positions",
    "rotary_positions",
    "unit_grid",
]


@attrs.frozen(eq=False)
class UnitGrid:
    """Per output token ("unit": ``merge^2`` patch rows) of a batch, its coordinates; per frame its table.

    Unit arrays (``(units,)`` int64): ``y``, ``x`` (row and column in the frame's merged grid), ``frame``.
    Frame arrays (``(frames,)`` int64): ``item``, ``height``, ``width`` (merged grid), ``start`` (first unit).
    """

    merge: int
    y: np.ndarray
    x: np.ndarray
    frame: np.ndarray
    item: np.ndarray
    height: np.ndarray
    width: np.ndarray
    start: np.ndarray

    @property
    def units(self) -> int:
        return int(self.y.shape[0])


def unit_grid(grid: np.ndarray, merge: int) -> UnitGrid:
    """The :class:`UnitGrid` of ``grid`` (``(n, 3)`` int64, ``h`` and ``w`` multiples of ``merge``)."""
    t = grid[:, 0]
    item = np.repeat(np.arange(grid.shape[0]), t)
    height = grid[item, 1] // merge
    width = grid[item, 2] // merge
    sizes = height * width
    start = np.zeros(sizes.shape[0], dtype=np.int64)
    np.cumsum(sizes[:-1], out=start[1:])
    frame = np.repeat(np.arange(sizes.shape[0]), sizes)
    within = np.arange(frame.shape[0]) - start[frame]
    w_unit = width[frame]
    y = within // w_unit
    return UnitGrid(merge, y, within - y * w_unit, frame, item, height, width, start)


def frame_bounds(units: UnitGrid) -> np.ndarray:
    """``cu_seqlens`` of the full-attention layers in patch rows: ``[0, end of frame 1, ...]`` (int64)."""
    rows = units.height * units.width * units.merge**2
    return np.concatenate(([0], np.cumsum(rows)))


def patch_coords(units: UnitGrid) -> tuple[np.ndarray, np.ndarray]:
    """``(row, col)`` of every patch row (``(units * merge^2,)`` int64 each) in its frame's patch grid.

    Patch rows come in merge-block order: token ``(y, x)``, then ``(i, j)`` within its ``merge x merge`` block.
    """
    m = units.merge
    inner = np.arange(m * m)
    row = (units.y[:, None] * m + inner[None, :] // m).reshape(-1)
    col = (units.x[:, None] * m + inner[None, :] % m).reshape(-1)
    return row, col


def rotary_positions(units: UnitGrid) -> np.ndarray:
    """``(rows, 2)`` int64 ``(row, col)`` patch positions for the 2-D rotary embedding, as
    ``transformers.vision_utils.get_vision_position_ids`` lays them out."""
    row, col = patch_coords(units)
    return np.stack((row, col), axis=1)


def raster_positions(units: UnitGrid) -> np.ndarray:
    """``(rows, 2)`` int64 ``(row, col)`` of every patch of the frames of ``units``, raster order within each."""
    m = units.merge
    height, width = units.height * m, units.width * m
    frame = np.repeat(np.arange(height.shape[0]), height * width)
    start = np.zeros(height.shape[0], dtype=np.int64)
    np.cumsum((height * width)[:-1], out=start[1:])
    within = np.arange(frame.shape[0]) - start[frame]
    row = within // width[frame]
    return np.stack((row, within - row * width[frame]), axis=1)


class FrameTableCache:
    """A bounded, thread-safe LRU cache of per-frame-shape metadata tables: ``(h, w) -> {name: array}``.

    Real traffic repeats frame shapes (the frames of a video, images resized to a few sizes), so most batches
    only concatenate cached tables. Misses of one lookup are computed together by ``compute`` (``(k, 2)``
    shapes -> ``k`` tables). ``capacity`` bounds the entries (a 896 x 896 px frame's tables are ~0.3 MB).
    """

    def __init__(self, compute: Callable[[np.ndarray], list[dict[str, np.ndarray]]], capacity: int = 128) -> None:
        self.compute = compute
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, int], dict[str, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, shapes: list[tuple[int, int]]) -> list[dict[str, np.ndarray]]:
        with self._lock:
            found = {key: self._entries.get(key) for key in dict.fromkeys(shapes)}
            missing = [key for key, table in found.items() if table is None]
            if missing:
                for key, table in zip(missing, self.compute(np.array(missing, dtype=np.int64).reshape(-1, 2))):
                    found[key] = table
                    self._entries[key] = table
            for key in found:
                self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            return [found[key] for key in shapes]  # type: ignore[misc]

    def __len__(self) -> int:
        return len(self._entries)


def grid_array(grid_thw: Any, name: str = "grid_thw", columns: str = "t, h, w") -> np.ndarray:
    """``grid_thw`` (or another per-item integer table, ``name`` with ``columns``) as an ``(n, k)`` int64 host
    array; a device tensor is copied once."""
    width = len(columns.split(","))
    if isinstance(grid_thw, torch.Tensor):
        if grid_thw.is_floating_point() or grid_thw.is_complex() or grid_thw.dtype == torch.bool:
            raise InputTypeError(f"{name}: expected an integer tensor, got {grid_thw.dtype}.")
        grid = grid_thw.detach().to("cpu", torch.int64).numpy()
    elif isinstance(grid_thw, (np.ndarray, list, tuple)):
        grid = np.asarray(grid_thw)
        if grid.dtype.kind not in "iu":
            raise InputTypeError(f"{name}: expected integers, got an array of {grid.dtype}.")
        grid = grid.astype(np.int64)
    else:
        raise InputTypeError(f"{name}: expected an integer tensor (n, {width}), got {describe(grid_thw)}.")
    if grid.ndim != 2 or grid.shape[1] != width or grid.shape[0] == 0:
        raise InputError(
            f"{name}: expected shape (n, {width}) with n >= 1 ({columns} per image or video), got {tuple(grid.shape)}."
        )
    return grid


def check_window(window_size: int, merge: int, patch: int) -> int:
    """Merged tokens per window side (``window_size // merge // patch``), at least 1."""
    side = int(window_size) // merge // patch
    if side < 1:
        raise ConfigError(
            f"window_size: {window_size} px is smaller than one merged token ({merge} x {patch} px); the tower's "
            "config is inconsistent."
        )
    return side
