"""What a call holds: visuals (images and videos as a user sends them), the fixed benchmark cases, the sizes a
tower sees for them (rounded as the processors round), and the tensors of one call in a tower's input layout.

Input layouts are a table by :class:`~benches.lib.towers.TowerKind`: ``_SIZES`` (how many patches and output
tokens a visual becomes) and ``_TENSORS`` (the random pixels and the keyword arguments of the tower's forward);
a tower kind with another layout adds one function to each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from encgraph.cli.geometry import smart_resize

from benches.lib.env import Env
from benches.lib.towers import Geometry, TowerKind


@attrs.frozen
class Visual:
    """One image or video as a user sends it: ``frames == 1`` is an image; ``kind`` names its category."""

    height: int
    width: int
    frames: int = 1
    kind: str = "image"

    @property
    def is_video(self) -> bool:
        return self.frames > 1


@attrs.frozen
class Case:
    """A fixed benchmark case: a name and the visuals of one call."""

    name: str
    visuals: tuple[Visual, ...]


CASES: tuple[Case, ...] = (
    Case("1x224", (Visual(224, 224),)),
    Case("4x224", (Visual(224, 224),) * 4),
    Case("8x336", (Visual(336, 336),) * 8),
    Case("1x896", (Visual(896, 896),)),
    Case("video8", (Visual(252, 448, frames=8, kind="video"),)),
)
SMOKE_VIDEO = Case("video4x112", (Visual(112, 112, frames=4, kind="video"),))
"""A small video for the CPU smoke (the video path without the quadratic cost of masked attention on a CPU)."""
ALL_CASES = CASES + (SMOKE_VIDEO,)
CASE_NAMES = tuple(c.name for c in ALL_CASES)
DEFAULT_CASE_NAMES = tuple(c.name for c in CASES)
SMOKE_CASES = ("1x224", "video4x112")

MIN_TOKENS = 4
"""Fewest merged tokens per frame a packed tower is given (Qwen's processors: 56 x 56 px at factor 28)."""
MAX_TILES = 12
"""Most tiles a fixed-resolution tower cuts one image into (InternVL's ``max_dynamic_patch``), thumbnail aside."""


def packed_grid(visual: Visual, geom: Geometry, max_tokens: float = math.inf) -> tuple[int, int, int]:
    """``(t, h, w)`` in patches for a packed tower: the frame resized (``smart_resize``, at most ``max_tokens``
    merged tokens per temporal slice), ``t = ceil(frames / temporal_patch)`` for a video, 1 for an image."""
    f = geom.factor
    h, w = smart_resize(visual.height, visual.width, f, MIN_TOKENS * f * f, max_tokens * f * f)
    t = -(-visual.frames // geom.temporal_patch) if visual.is_video else 1
    return t, h // geom.patch, w // geom.patch


def fixed_tiles(visual: Visual, geom: Geometry) -> int:
    """Tiles a fixed-resolution tower sees: one per video frame; for an image one when it fits the tower's side,
    else ``min(ceil(h/S) * ceil(w/S), 12)`` tiles plus a thumbnail (InternVL's dynamic tiling)."""
    side = int(geom.image_size)  # type: ignore[arg-type]
    if visual.is_video:
        return visual.frames
    if max(visual.height, visual.width) <= side:
        return 1
    return min(-(-visual.height // side) * -(-visual.width // side), MAX_TILES) + 1


@attrs.frozen
class Sizes:
    """Token counts of one call on one tower: ``items`` (images/videos), ``patches`` (rows through the blocks),
    ``tokens`` (the tower's output tokens: merged patches, or tiles x patches per tile), ``grids``."""

    items: int
    patches: int
    tokens: int
    grids: tuple[tuple[int, int, int], ...] = ()
    tiles: int = 0


def _packed_sizes(visuals: Sequence[Visual], geom: Geometry, image_cap: float, frame_cap: float) -> Sizes:
    grids = tuple(packed_grid(v, geom, frame_cap if v.is_video else image_cap) for v in visuals)
    patches = sum(t * h * w for t, h, w in grids)
    return Sizes(len(visuals), patches, patches // geom.merge**2, grids)


def _fixed_sizes(visuals: Sequence[Visual], geom: Geometry, image_cap: float, frame_cap: float) -> Sizes:
    tiles = sum(fixed_tiles(v, geom) for v in visuals)
    per_tile = (int(geom.image_size) // geom.patch) ** 2  # type: ignore[arg-type]
    return Sizes(len(visuals), tiles * per_tile, tiles * per_tile, tiles=tiles)


_SIZES: dict[TowerKind, Callable[[Sequence[Visual], Geometry, float, float], Sizes]] = {
    TowerKind.PACKED: _packed_sizes,
    TowerKind.FIXED: _fixed_sizes,
}


def sizes_of(visuals: Sequence[Visual], geom: Geometry, *, max_image_tokens: float = math.inf,
             max_frame_tokens: float = math.inf) -> Sizes:
    """The :class:`Sizes` of ``visuals`` on a tower of ``geom`` (caps in merged tokens per frame)."""
    return _SIZES[geom.kind](visuals, geom, max_image_tokens, max_frame_tokens)


@attrs.frozen
class BenchInputs:
    """One call's tensors for every system: ``hf`` (args, kwargs) for the tower's own forward, ``adapter`` for the
    runners (``None`` without an adapter), and its :class:`Sizes`."""

    hf_args: tuple[Any, ...]
    hf_kwargs: Mapping[str, Any]
    adapter: Any
    sizes: Sizes


def _packed_tensors(sizes: Sizes, geom: Geometry, env: Env, gen: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import torch

    pixels = torch.randn(sizes.patches, geom.row_size, device=env.device, dtype=env.dtype, generator=gen)
    # HF's own callers move grid_thw to the device with the pixels (the adapter copies it to the host for its
    # planning: part of what a drop-in costs).
    return (pixels,), {"grid_thw": torch.tensor(sizes.grids, dtype=torch.int64).to(env.device)}


def _fixed_tensors(sizes: Sizes, geom: Geometry, env: Env, gen: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import torch

    side = int(geom.image_size)  # type: ignore[arg-type]
    pixels = torch.randn(sizes.tiles, geom.channels, side, side, device=env.device, dtype=env.dtype, generator=gen)
    return (), {"pixel_values": pixels}


_TENSORS: dict[TowerKind, Callable[[Sizes, Geometry, Env, Any], tuple[tuple[Any, ...], dict[str, Any]]]] = {
    TowerKind.PACKED: _packed_tensors,
    TowerKind.FIXED: _fixed_tensors,
}


def adapter_inputs(adapter: Any, kind: TowerKind, hf_args: tuple[Any, ...], hf_kwargs: Mapping[str, Any]) -> Any:
    """The adapter's inputs for a call, from the tower's own arguments. A packed tower's grid is handed over on
    the host (the adapter plans on it; a host grid spares the runner systems a device sync per call)."""
    if kind is TowerKind.PACKED:
        return adapter.inputs_from_call(*hf_args, grid_thw=hf_kwargs["grid_thw"].cpu())
    return adapter.inputs_from_call(*hf_args, **hf_kwargs)


def make_inputs(visuals: Sequence[Visual], geom: Geometry, env: Env, adapter: Any = None, *, seed: int = 0,
                max_image_tokens: float = math.inf, max_frame_tokens: float = math.inf) -> BenchInputs:
    """Random pixels (standard normal, seeded by ``env.seed`` and ``seed``) for ``visuals`` in the layout of a
    tower of ``geom``; the adapter's inputs too when ``adapter`` is given."""
    import torch

    sizes = sizes_of(visuals, geom, max_image_tokens=max_image_tokens, max_frame_tokens=max_frame_tokens)
    gen = torch.Generator(device=env.device).manual_seed(env.seed * 1_000_003 + seed)
    hf_args, hf_kwargs = _TENSORS[geom.kind](sizes, geom, env, gen)
    wrapped = None if adapter is None else adapter_inputs(adapter, geom.kind, hf_args, hf_kwargs)
    return BenchInputs(hf_args, hf_kwargs, wrapped, sizes)
