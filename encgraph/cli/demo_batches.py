"""The batches ``encgraph demo`` sends to the embedded towers (:mod:`encgraph.embedded_towers`): seeded, shaped as
the towers' processors would produce them, and mixed so that the plan shows padding, several budgets and the eager
fallback. Building a batch imports torch; importing this module does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from encgraph.cli.geometry import TOWERS as GEOMETRIES
from encgraph.cli.geometry import TowerGeometry
from encgraph.embedded_towers import DemoTower

if TYPE_CHECKING:  # torch is imported when a batch is built, not when the command line is parsed
    import torch

__all__ = ["DemoItem", "DemoBatch", "make_batch"]


@attrs.frozen
class DemoItem:
    """One item of the demo batch: what it is (for the printout) and the tower's arguments for it alone."""

    kind: str
    label: str
    grid: tuple[int, int, int] | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@attrs.frozen
class DemoBatch:
    """The whole batch: the tower's arguments for all items at once, and the items one by one."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    items: tuple[DemoItem, ...]


def make_batch(spec: DemoTower, tower: torch.nn.Module, *, seed: int, ladder: Sequence[int]) -> DemoBatch:
    """A seeded batch for ``tower``: for a Qwen tower, four images of random sizes, a 4-frame video, and one
    image larger than the largest budget (to show the eager fallback); for a fixed-size tower, enough images
    for one full largest batch and a padded one."""
    import torch

    param = next(tower.parameters())
    gen = torch.Generator().manual_seed(seed)
    if spec.name in _BATCHES:
        return _BATCHES[spec.name](tower, gen, param, ladder)
    if spec.geometry is None:
        return _fixed_batch(tower, gen, param, ladder)
    return _qwen_batch(GEOMETRIES[spec.geometry], np.random.default_rng(seed), gen, param, ladder)


def _qwen_batch(
    g: TowerGeometry, rng: np.random.Generator, gen: torch.Generator, param: torch.Tensor, ladder: Sequence[int]
) -> DemoBatch:
    import torch

    # Demo bounds: at least 2x2 merged tokens per image (the processor's `size` option allows it; Qwen3-VL's
    # default minimum of 256x256 pixels would make every image 64 tokens or more), sides scaled to the ladder so
    # that the images spread over its budgets.
    g = attrs.evolve(g, min_pixels=4 * g.factor**2)
    low, high = 2 * g.factor, g.factor * max(3, math.isqrt(max(ladder) // 2))
    # (kind, width, height, frames)
    sizes: list[tuple[str, int, int, int]] = []
    for _ in range(4):
        sizes.append(("image", int(rng.integers(low, high)), int(rng.integers(low, high)), 1))
    sizes.append(("video", int(rng.integers(low, high)), int(rng.integers(low, high)), 2 * g.temporal_patch_size))
    # One image over the largest budget, to show the eager fallback.
    side = g.factor * math.ceil(math.sqrt(1.3 * max(ladder)))
    sizes.append(("image", side, side, 1))
    items, rows, grids = [], [], []
    for kind, w, h, frames in sizes:
        (_, gh, gw), (rw, rh) = g.image_grid(w, h)
        grid = (-(-frames // g.temporal_patch_size), gh, gw)  # an image fills one temporal patch
        pixels = torch.randn(math.prod(grid), g.patch_dim, generator=gen).to(param.device, param.dtype)
        grid_thw = torch.tensor([grid], dtype=torch.int64, device=param.device)
        label = f"{w}x{h} -> {rw}x{rh}" + (f", {frames} frames" if frames > 1 else "")
        items.append(DemoItem(kind, label, grid, (pixels,), {"grid_thw": grid_thw}))
        rows.append(pixels)
        grids.append(grid_thw)
    return DemoBatch((torch.cat(rows),), {"grid_thw": torch.cat(grids)}, tuple(items))


def _fixed_batch(tower: torch.nn.Module, gen: torch.Generator, param: torch.Tensor, ladder: Sequence[int]) -> DemoBatch:
    import torch

    c = tower.config
    size = int(c.image_size)
    count = max(ladder) + max(1, max(ladder) // 2 - 1)
    pixels = torch.randn(count, int(c.num_channels), size, size, generator=gen).to(param.device, param.dtype)
    items = tuple(
        DemoItem("image", f"{size}x{size}", None, (pixels[i : i + 1],), {}) for i in range(count)
    )
    return DemoBatch((pixels,), {}, items)


def _gemma4_batch(tower: torch.nn.Module, gen: torch.Generator, param: torch.Tensor, ladder: Any) -> DemoBatch:
    """Gemma-4: patch rows padded to one length with ``(-1, -1)`` positions, as its processors pad them: three
    images for the image path, two frame-sized items for the video path, and one image over the largest image
    budget (its path runs eagerly while the others replay)."""
    import torch

    from encgraph.models.gemma4_layout import grid_positions

    k = int(tower.config.pooling_kernel_size)
    over = math.isqrt(max(ladder["image"])) + 1
    # (pooled width, pooled height): soft tokens = w * h; at most 70 go to the video path.
    pooled = [(12, 8), (15, 12), (16, 16), (10, 7), (6, 5), (over, over)]
    rows = max(w * h for w, h in pooled) * k * k
    channels = int(tower.patch_embedder.input_proj.in_features)
    pv = torch.zeros(len(pooled), rows, channels)
    pos = torch.full((len(pooled), rows, 2), -1, dtype=torch.int64)
    items = []
    for i, (w, h) in enumerate(pooled):
        n = w * h * k * k
        pos[i, :n] = torch.from_numpy(grid_positions(w * k, h * k))
        pv[i, :n] = torch.rand(n, channels, generator=gen)
    pv, pos = pv.to(param.device, param.dtype), pos.to(param.device)
    for i, (w, h) in enumerate(pooled):
        kind = "video" if i == 4 else "image"  # item 4: one frame of a video
        label = f"{w * k}x{h * k} patches" + (" (a frame)" if i == 4 else "")
        items.append(DemoItem(kind, label, None, (pv[i : i + 1],), {"pixel_position_ids": pos[i : i + 1]}))
    return DemoBatch((pv,), {"pixel_position_ids": pos}, tuple(items))


_BATCHES: dict[str, Callable[..., DemoBatch]] = {"gemma4": _gemma4_batch}
"""Towers whose batches are neither Qwen-VL rows nor fixed-size images."""
