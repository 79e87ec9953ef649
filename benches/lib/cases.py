"""What a call holds: visuals (images and videos as a user sends them), the fixed benchmark cases, the sizes a
tower sees for them (rounded as the processors round), and the tensors of one call in a tower's input layout.

Input layouts are a table by :class:`~benches.lib.towers.TowerKind`: ``_SIZES`` (how many patches and output
tokens a visual becomes) and ``_TENSORS`` (the random pixels and the keyword arguments of the tower's forward);
a tower kind with another layout adds one function to each. Each kind follows its family's processor at its
default settings:

- ``PACKED``, ``PATCHES``, ``BATCH1`` (Qwen-VL, GLM-4V, Qwen3.5, ERNIE-4.5-VL, Kimi-K2.5, PaddleOCR-VL): sides rounded to multiples of
  patch x merge (``smart_resize``), so 448 px stays 448 (Qwen3.5 at factor 32 too) and 336 px becomes 320 at
  factor 32;
- ``FIXED`` (SigLIP, InternViT, Llama 4's 336 px tiles): tiles of the tower's side (a 448 px image: 2 x 2 tiles
  plus a thumbnail, as Llama 4's processor makes it: 5 tiles);
- ``IMAGES`` (Pixtral): an image scaled down to at most ``PIXTRAL_LONGEST_EDGE`` a side (aspect kept), sides
  rounded up to multiples of the patch: 448 and 336 px stay as they are; the call's images zero-padded to the
  largest; videos are refused;
- ``NAFLEX`` (SigLIP2 NaFlex): an image resized, aspect kept, to the most patches ``NAFLEX_MAX_PATCHES`` allows
  (``get_image_size_for_max_num_patches``: 448 and 336 px both become 16 x 16 patches at patch 16), its rows
  padded to that many; videos are refused;
- ``STRIP`` (MiniCPM-V 4.6): an image of at most 448 x 448 px is resized to about that area (up or down), sides
  multiples of 4 patches, and not sliced: 448 and 336 px both become 32 x 32 patches (256 tokens after the
  tower's window merger); a larger image (the processor slices it) or a video is refused;
- ``PADDED`` (Gemma-4): every image resized to the patch budget of ``max_soft_tokens = 280`` (2520 patches,
  sides multiples of the 3 x 3 pooling), then padded to 2520 rows: any square image is 48 x 48 patches (256 soft
  tokens); videos are refused;
- ``MASKED`` (Idefics3, SmolVLM): the image's longest edge resized to ``IDEFICS_TILES_PER_SIDE`` tiles (up or
  down, aspect kept), then each side up to whole tiles, cut into tiles plus a global tile where there is more than
  one (448 and 336 px both become 4 x 4 + 1 = 17 tiles); a full ``patch_attention_mask``, as the processor gives
  for tiles; videos are refused (SmolVLM's frames are images of one tile: not modelled);
- ``VIEWS`` (Step-3.7): one 728 px global view per image, plus 504 px crops where the processor cuts them
  (only images over 728 px, or elongated ones: none at 448 or 336 px; ``1x896`` has 4); videos are refused.
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


class CaseError(ValueError):
    """A visual a tower's input layout does not model (its processor would slice it, or the tower takes no video):
    ``towers.py`` records the case as not applicable."""


CASES: tuple[Case, ...] = (
    Case("1x224", (Visual(224, 224),)),
    Case("4x224", (Visual(224, 224),) * 4),
    Case("8x336", (Visual(336, 336),) * 8),
    Case("1x896", (Visual(896, 896),)),
    Case("video8", (Visual(252, 448, frames=8, kind="video"),)),
)
SMOKE_VIDEO = Case("video4x112", (Visual(112, 112, frames=4, kind="video"),))
"""A small video for the CPU smoke (the video path without the quadratic cost of masked attention on a CPU)."""
FAMILY_CASES_EXTRA = (Case("1x448", (Visual(448, 448),)),)
"""Cases of the family rows beyond :data:`CASES` (their cases are ``towers.FAMILY_CASES``: 1x448 and 8x336)."""
PHOTO_CASE = Case("photo", (Visual(3000, 4000),))
"""One 4000 x 3000 photo, as each tower's processor sizes it at its default maximum: ``towers.py`` caps packed
towers by ``trace.photo_caps`` (the processor's ``max_pixels``); Pixtral, SigLIP2 NaFlex and Idefics3/SmolVLM cap
themselves here (longest edge 1024 px; 256 patches; 4 tiles a side)."""
LARGE_CASES = (Case("1x2688", (Visual(2688, 2688),)),)
"""One photo past every default ladder's top (GLM-4.1V and Qwen: 36,864 patch rows, 9,216 tokens): where a
forward's time goes on the images that run eagerly (``kernel_profile.py --cases 1x2688``)."""
ALL_CASES = CASES + (SMOKE_VIDEO, *FAMILY_CASES_EXTRA, PHOTO_CASE, *LARGE_CASES)
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
    ``tokens`` (the tower's output tokens: merged patches, or tiles x patches per tile), ``grids`` (``(t, h, w)``
    in patches per item, for every layout with per-item sizes)."""

    items: int
    patches: int
    tokens: int
    grids: tuple[tuple[int, int, int], ...] = ()
    tiles: int = 0
    crops: tuple[int, ...] = ()
    """Local crops per image of a ``VIEWS`` tower (its ``tiles`` count global views and crops)."""


def _packed_sizes(visuals: Sequence[Visual], geom: Geometry, image_cap: float, frame_cap: float) -> Sizes:
    grids = tuple(packed_grid(v, geom, frame_cap if v.is_video else image_cap) for v in visuals)
    patches = sum(t * h * w for t, h, w in grids)
    return Sizes(len(visuals), patches, patches // geom.merge**2, grids)


def _fixed_sizes(visuals: Sequence[Visual], geom: Geometry, image_cap: float, frame_cap: float) -> Sizes:
    tiles = sum(fixed_tiles(v, geom) for v in visuals)
    per_tile = (int(geom.image_size) // geom.patch) ** 2  # type: ignore[arg-type]
    return Sizes(len(visuals), tiles * per_tile, tiles * per_tile, tiles=tiles)


MINICPM_SCALE = 448
"""MiniCPM-V's ``scale_resolution``: the area (its square) an unsliced image is resized to."""
MINICPM_SIDE_PATCHES = 4
"""MiniCPM-V's sides are multiples of 4 patches: its default "16x" mode merges 2 x 2 twice (the tower's window
merger, then the model's)."""
GEMMA4_MAX_SOFT_TOKENS = 280
"""Gemma-4's image processor default: at most 280 soft tokens, i.e. 280 x 3 x 3 patches, the padded row count."""
STEP_CROP_PATCHES = 36
"""Step-3.7's crops are 36 patches a side (504 px at patch 14: the processor's ``patch_size``)."""
STEP_MAX_IMAGE = 3024
"""Step-3.7's ``max_image_size``: larger images are scaled down before cropping."""


def _images_only(visuals: Sequence[Visual], layout: str) -> None:
    if any(v.is_video for v in visuals):
        raise CaseError(f"a {layout} tower's benchmark inputs are images only, got a video")


PIXTRAL_LONGEST_EDGE = 1024
"""Pixtral-12B's image processor default (``size={"longest_edge": 1024}``): the longest side an image keeps."""


def pixtral_grid(visual: Visual, geom: Geometry) -> tuple[int, int, int]:
    """``(1, h, w)`` in patches of an image as Pixtral's processor resizes it (``get_resize_output_image_size``):
    scaled down to fit ``PIXTRAL_LONGEST_EDGE`` (floored), then each side rounded up to whole patches."""
    ratio = max(visual.height, visual.width) / PIXTRAL_LONGEST_EDGE
    h, w = ((math.floor(x / ratio) if ratio > 1 else x) for x in (visual.height, visual.width))
    return 1, -(-h // geom.patch), -(-w // geom.patch)


NAFLEX_MAX_PATCHES = 256
"""SigLIP2's NaFlex image processor default (``max_num_patches=256``): the rows each image is padded to."""


def naflex_grid(visual: Visual, geom: Geometry) -> tuple[int, int, int]:
    """``(1, h, w)`` in patches of an image as SigLIP2's NaFlex processor resizes it (transformers' own helper, from
    its Pillow processor's module: the torchvision one's imports torchvision, which a CPU torch may lack)."""
    from transformers.models.siglip2.image_processing_pil_siglip2 import (
        get_image_size_for_max_num_patches,
    )

    h, w = get_image_size_for_max_num_patches(visual.height, visual.width, geom.patch, NAFLEX_MAX_PATCHES)
    return 1, h // geom.patch, w // geom.patch


def strip_grid(visual: Visual, geom: Geometry) -> tuple[int, int, int]:
    """``(1, h, w)`` in patches of an image as MiniCPM-V's processor resizes it (``find_best_resize`` with
    upscaling, no slices); refuses an image over ``MINICPM_SCALE`` squared, which the processor slices."""
    if visual.height * visual.width > MINICPM_SCALE**2:
        raise CaseError(f"MiniCPM-V slices an image over {MINICPM_SCALE} x {MINICPM_SCALE} px (not modelled), got "
                        f"{visual.height} x {visual.width}")
    aspect = visual.width / visual.height
    height = int(MINICPM_SCALE / math.sqrt(aspect))
    width = int(height * aspect)
    side = geom.patch * MINICPM_SIDE_PATCHES
    h, w = (max(round(x / side) * side, side) for x in (height, width))
    return 1, h // geom.patch, w // geom.patch


def padded_grid(visual: Visual, geom: Geometry) -> tuple[int, int, int]:
    """``(1, h, w)`` in patches of an image as Gemma-4's processor resizes it: aspect kept, as large as
    ``GEMMA4_MAX_SOFT_TOKENS`` allows, sides multiples of pooling x patch (``get_aspect_ratio_preserving_size``)."""
    p, side = geom.patch, geom.merge * geom.patch
    max_patches = GEMMA4_MAX_SOFT_TOKENS * geom.merge**2
    factor = math.sqrt(max_patches * p * p / (visual.height * visual.width))
    h, w = (math.floor(factor * x / side) * side for x in (visual.height, visual.width))
    longest = GEMMA4_MAX_SOFT_TOKENS * side
    if h == 0:
        h, w = side, min(math.floor(visual.width / visual.height) * side, longest)
    elif w == 0:
        h, w = min(math.floor(visual.height / visual.width) * side, longest), side
    return 1, h // p, w // p


def view_crops(visual: Visual, geom: Geometry) -> int:
    """Local crops Step-3.7's processor cuts from an image (``_plan_patches``): none when the image fits the
    global view and is not elongated (long side over 1.5 x the short), else a grid of windows of the crop side
    (of the short side for a very elongated image), each side snapped up when its rest passes 20% of a window."""
    width, height, crop, view = visual.width, visual.height, STEP_CROP_PATCHES * geom.patch, int(geom.image_size)
    if min(width, height) < 32 and max(width / height, height / width) > 4:
        width = height = max(width, height)
    if max(width, height) > STEP_MAX_IMAGE:
        scale = STEP_MAX_IMAGE / max(width, height)
        width, height = int(width * scale), int(height * scale)
    short, long = min(width, height), max(width, height)
    if long <= view:
        window = short if long / short > 1.5 else 0
    else:
        window = min(short, crop) if long / short > 4 else crop
    if window == 0:
        return 0

    def count(dim: int) -> int:
        snapped = window * (dim // window + (dim % window > 0.2 * window)) if dim >= window else dim
        return max(1, snapped // window)

    return count(width) * count(height)


IDEFICS_TILES_PER_SIDE = 4
"""Idefics3's and SmolVLM's ``size["longest_edge"]`` in tiles (``max_image_size``): 4 x 364 and 4 x 384 px."""


def idefics_tiles(visual: Visual, geom: Geometry) -> int:
    """Tiles Idefics3's / SmolVLM's image processor cuts an image into (``resize`` to the longest edge, then
    ``resize_for_vision_encoder`` and ``split_images``): ``rows * cols`` tiles plus the global one, or 1."""
    side = int(geom.image_size)  # type: ignore[arg-type]
    height, width = visual.height, visual.width
    longest, aspect = IDEFICS_TILES_PER_SIDE * side, visual.width / visual.height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
        width = -(-width // side) * side
        height = -(-int(width / aspect) // side) * side
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
        height = -(-height // side) * side
        width = -(-int(height * aspect) // side) * side
    if height <= side and width <= side:
        return 1
    return (height // side) * (width // side) + 1


def _masked_sizes(visuals: Sequence[Visual], geom: Geometry, image_cap: float, frame_cap: float) -> Sizes:
    _images_only(visuals, "Idefics3 / SmolVLM")
    tiles = sum(idefics_tiles(v, geom) for v in visuals)
    side = int(geom.image_size) // geom.patch  # type: ignore[arg-type]
    return Sizes(len(visuals), tiles * side * side, tiles * side * side, ((1, side, side),) * tiles, tiles=tiles)


def _grid_sizes(grid_of: Callable[[Visual, Geometry], tuple[int, int, int]], layout: str) -> Callable[..., Sizes]:
    def sizes(visuals: Sequence[Visual], geom: Geometry, image_cap: float, frame_cap: float) -> Sizes:
        _images_only(visuals, layout)
        grids = tuple(grid_of(v, geom) for v in visuals)
        patches = sum(t * h * w for t, h, w in grids)
        return Sizes(len(visuals), patches, patches // geom.merge**2, grids)

    return sizes


def _views_sizes(visuals: Sequence[Visual], geom: Geometry, image_cap: float, frame_cap: float) -> Sizes:
    from encgraph.models.step3p7 import view_tokens

    _images_only(visuals, "Step-3.7")
    crops = tuple(view_crops(v, geom) for v in visuals)
    view, crop = int(geom.image_size), STEP_CROP_PATCHES * geom.patch  # type: ignore[arg-type]
    patches = len(visuals) * (view // geom.patch) ** 2 + sum(crops) * STEP_CROP_PATCHES**2
    tokens = len(visuals) * view_tokens(view, geom.patch) + sum(crops) * view_tokens(crop, geom.patch)
    return Sizes(len(visuals), patches, tokens, tiles=len(visuals) + sum(crops), crops=crops)


_SIZES: dict[TowerKind, Callable[[Sequence[Visual], Geometry, float, float], Sizes]] = {
    TowerKind.PACKED: _packed_sizes,
    TowerKind.FIXED: _fixed_sizes,
    TowerKind.PATCHES: _packed_sizes,
    TowerKind.BATCH1: _packed_sizes,
    TowerKind.IMAGES: _grid_sizes(pixtral_grid, "Pixtral"),
    TowerKind.NAFLEX: _grid_sizes(naflex_grid, "SigLIP2 NaFlex"),
    TowerKind.STRIP: _grid_sizes(strip_grid, "MiniCPM-V"),
    TowerKind.PADDED: _grid_sizes(padded_grid, "Gemma-4"),
    TowerKind.MASKED: _masked_sizes,
    TowerKind.VIEWS: _views_sizes,
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


def _patch_rows_tensors(sizes: Sizes, geom: Geometry, env: Env, gen: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import torch

    pixels = torch.randn(sizes.patches, geom.channels, geom.patch, geom.patch, device=env.device, dtype=env.dtype,
                         generator=gen)
    return (pixels,), {"grid_thw": torch.tensor(sizes.grids, dtype=torch.int64).to(env.device)}


def _batch1_tensors(sizes: Sizes, geom: Geometry, env: Env, gen: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (pixels,), kwargs = _patch_rows_tensors(sizes, geom, env, gen)
    return (pixels.unsqueeze(0),), kwargs


def _images_tensors(sizes: Sizes, geom: Geometry, env: Env, gen: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import torch

    sides = torch.tensor([(h * geom.patch, w * geom.patch) for _, h, w in sizes.grids], dtype=torch.int64)
    pixels = torch.zeros(sizes.items, geom.channels, *sides.max(0).values.tolist(), device=env.device, dtype=env.dtype)
    for image, (h, w) in zip(pixels, sides.tolist()):
        image[:, :h, :w] = torch.randn(geom.channels, h, w, device=env.device, generator=gen).to(env.dtype)
    return (pixels,), {"image_sizes": sides.to(env.device)}


def _naflex_tensors(sizes: Sizes, geom: Geometry, env: Env, gen: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import torch

    pixels = torch.zeros(sizes.items, NAFLEX_MAX_PATCHES, geom.row_size, device=env.device, dtype=env.dtype)
    mask = torch.zeros(sizes.items, NAFLEX_MAX_PATCHES, dtype=torch.int32)
    for i, (_, h, w) in enumerate(sizes.grids):
        pixels[i, : h * w] = torch.randn(h * w, geom.row_size, device=env.device, generator=gen).to(env.dtype)
        mask[i, : h * w] = 1
    shapes = torch.tensor([(h, w) for _, h, w in sizes.grids], dtype=torch.int64)
    return (), {"pixel_values": pixels, "pixel_attention_mask": mask.to(env.device),
                "spatial_shapes": shapes.to(env.device)}


def _strip_tensors(sizes: Sizes, geom: Geometry, env: Env, gen: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import torch

    strip = torch.randn(1, geom.channels, geom.patch, sizes.patches * geom.patch, device=env.device, dtype=env.dtype,
                        generator=gen)
    target_sizes = torch.tensor([(h, w) for _, h, w in sizes.grids], dtype=torch.int64)
    return (strip,), {"target_sizes": target_sizes.to(env.device)}


def _padded_tensors(sizes: Sizes, geom: Geometry, env: Env, gen: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # As the processor pads: each image's patches in raster order, then zero rows at position (-1, -1); values
    # in [0, 1] (it rescales and does not normalise).
    import numpy as np
    import torch

    from encgraph.models.gemma4_layout import grid_positions

    rows = GEMMA4_MAX_SOFT_TOKENS * geom.merge**2
    pixels = torch.zeros(sizes.items, rows, geom.row_size, device=env.device, dtype=env.dtype)
    positions = np.full((sizes.items, rows, 2), -1, np.int64)
    for i, (_, h, w) in enumerate(sizes.grids):
        positions[i, : h * w] = grid_positions(w, h)
        pixels[i, : h * w] = torch.rand(h * w, geom.row_size, device=env.device, generator=gen).to(env.dtype)
    return (pixels, torch.from_numpy(positions).to(env.device)), {}


def _masked_tensors(sizes: Sizes, geom: Geometry, env: Env, gen: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import torch

    side = int(geom.image_size)  # type: ignore[arg-type]
    pixels = torch.randn(sizes.tiles, geom.channels, side, side, device=env.device, dtype=env.dtype, generator=gen)
    mask = torch.ones(sizes.tiles, side // geom.patch, side // geom.patch, dtype=torch.bool, device=env.device)
    return (pixels,), {"patch_attention_mask": mask}


def _views_tensors(sizes: Sizes, geom: Geometry, env: Env, gen: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import torch

    def views(n: int, side: int) -> Any:
        return torch.randn(n, geom.channels, side, side, device=env.device, dtype=env.dtype, generator=gen)

    crops = sum(sizes.crops)
    local = views(crops, STEP_CROP_PATCHES * geom.patch) if crops else None
    return (views(sizes.items, int(geom.image_size)), local, list(sizes.crops)), {}  # type: ignore[arg-type]


_TENSORS: dict[TowerKind, Callable[[Sizes, Geometry, Env, Any], tuple[tuple[Any, ...], dict[str, Any]]]] = {
    TowerKind.PACKED: _packed_tensors,
    TowerKind.FIXED: _fixed_tensors,
    TowerKind.PATCHES: _patch_rows_tensors,
    TowerKind.BATCH1: _batch1_tensors,
    TowerKind.IMAGES: _images_tensors,
    TowerKind.NAFLEX: _naflex_tensors,
    TowerKind.STRIP: _strip_tensors,
    TowerKind.PADDED: _padded_tensors,
    TowerKind.MASKED: _masked_tensors,
    TowerKind.VIEWS: _views_tensors,
}
_HOST_GRIDS = {TowerKind.PACKED: "grid_thw", TowerKind.PATCHES: "grid_thw", TowerKind.BATCH1: "grid_thw",
               TowerKind.IMAGES: "image_sizes", TowerKind.STRIP: "target_sizes", TowerKind.NAFLEX: "spatial_shapes",
               TowerKind.MASKED: "patch_attention_mask"}
"""The keyword of each kind's per-item sizes, which the adapter systems get on the host."""


def adapter_inputs(adapter: Any, kind: TowerKind, hf_args: tuple[Any, ...], hf_kwargs: Mapping[str, Any]) -> Any:
    """The adapter's inputs for a call, from the tower's own arguments. A packed tower's grid (a strip's target
    sizes) is handed over on the host (the adapter plans on it; a host grid spares the runner systems a device
    sync per call)."""
    key = _HOST_GRIDS.get(kind)
    if key is not None:
        return adapter.inputs_from_call(*hf_args, **{**hf_kwargs, key: hf_kwargs[key].cpu()})
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
