"""Tower geometries for planning without a model: patch and merge sizes and the HF processor's resize rule.

Torch-free (``encgraph plan`` must start fast and run where torch is not installed).  The constants are the
ones the released checkpoints' ``preprocessor_config.json`` give: Qwen2-VL and Qwen2.5-VL resize images to
multiples of 28 px within 3136 .. 12845056 pixels (``min_pixels``/``max_pixels``); Qwen3-VL to multiples of
32 px within 65536 .. 16777216 pixels (``size.shortest_edge``/``size.longest_edge``).
"""

from __future__ import annotations

import math

import attrs

from encgraph._validate import check_int
from encgraph.errors import ConfigError, InputError

__all__ = ["TowerGeometry", "TOWERS", "smart_resize"]


@attrs.frozen
class TowerGeometry:
    """How a Qwen-VL-style processor turns an image into patches, and the tower's patches into tokens.

    Attributes:
        name: the ``--tower`` name.
        patch_size: pixels per patch side.
        merge_size: patches per merged token side (the merger turns ``merge_size**2`` patches into a token).
        temporal_patch_size: frames per temporal patch (an image is repeated to fill one).
        min_pixels, max_pixels: the processor's pixel bounds for a resized image.
        max_frames_per_item: the adapter's default ``max_frames_per_item`` (``encgraph.models.qwen_vl``): the
            runner's default ``max_frames`` is ``max_items`` times this.
    """

    name: str
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    max_frames_per_item: int

    @property
    def factor(self) -> int:
        """Pixels per merged-token side: resized image sides are multiples of this."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per ``pixel_values`` row (one patch of 3 channels over ``temporal_patch_size`` frames)."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def with_pixels(self, min_pixels: int | None, max_pixels: int | None) -> TowerGeometry:
        """A copy with the processor's pixel bounds overridden (``None`` keeps the default)."""
        lo = self.min_pixels if min_pixels is None else check_int("--min-pixels", min_pixels, minimum=1)
        hi = self.max_pixels if max_pixels is None else check_int("--max-pixels", max_pixels, minimum=1)
        if hi < lo:
            raise ConfigError(
                f"--max-pixels: expected at least --min-pixels={lo}, got {hi}. Raise --max-pixels or lower "
                f"--min-pixels."
            )
        return attrs.evolve(self, min_pixels=lo, max_pixels=hi)

    def image_grid(self, width: int, height: int) -> tuple[tuple[int, int, int], tuple[int, int]]:
        """The patch grid ``(t, h, w)`` of an image and its resized ``(width, height)`` in pixels."""
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return (1, h // self.patch_size, w // self.patch_size), (w, h)

    def check_grid(self, grid: tuple[int, int, int], where: str) -> None:
        """Raise ``InputError`` unless ``grid`` is a grid the processor can produce (sides multiples of merge)."""
        t, h, w = grid
        m = self.merge_size
        if t < 1 or h < 1 or w < 1 or h % m or w % m:
            raise InputError(
                f"{where}: expected a grid t,h,w in patches with t >= 1 and h, w positive multiples of the merge "
                f"size {m} ({self.name}), got {t},{h},{w}. Give the grid_thw row the processor produced."
            )

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Output tokens (after the merger) of an item with this patch grid."""
        t, h, w = grid
        return t * h * w // (self.merge_size * self.merge_size)

    def describe(self) -> str:
        return (
            f"{self.name}: patch {self.patch_size} px, merge {self.merge_size}x{self.merge_size}, temporal patch "
            f"{self.temporal_patch_size}; images resized to multiples of {self.factor} px within "
            f"{self.min_pixels}..{self.max_pixels} pixels"
        )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen-VL image processor's resize rule: ``(height, width)`` rounded to multiples of ``factor``, scaled
    (keeping the aspect ratio) to lie within ``min_pixels .. max_pixels``.  Returns ``(height, width)``.

    Same arithmetic as ``transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize`` (Python's
    ``round`` included, so ties round to even as there).

    >>> smart_resize(480, 640, 28, 3136, 12845056)
    (476, 644)
    >>> smart_resize(10, 10, 28, 3136, 12845056)
    (56, 56)

    Raises:
        InputError: a side is < 1, or the aspect ratio is over 200 (the processor rejects those too).
    """
    if height < 1 or width < 1:
        raise InputError(f"image size: expected positive width and height, got {width}x{height}.")
    if max(height, width) / min(height, width) > 200:
        raise InputError(
            f"image size: expected an aspect ratio of at most 200 (the processor's limit), got {width}x{height}. "
            f"Crop or pad the image."
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


#: The geometries ``encgraph plan --tower`` knows.
TOWERS: dict[str, TowerGeometry] = {
    g.name: g
    for g in (
        TowerGeometry("qwen2_vl", 14, 2, 2, 56 * 56, 12845056, max_frames_per_item=2),
        TowerGeometry("qwen2_5_vl", 14, 2, 2, 56 * 56, 12845056, max_frames_per_item=2),
        TowerGeometry("qwen3_vl", 16, 2, 2, 65536, 16777216, max_frames_per_item=2),
    )
}
