"""Item sizes from text: ``WxH`` image pixels, ``t,h,w`` patch grids, or JSON lines (torch-free).

One item per line; blank lines and lines starting with ``#`` are skipped.  Accepted forms::

    640x480                      an image, width x height in pixels (resized by the tower's processor rule)
    2,16,24                      a patch grid t,h,w (a grid_thw row: a video when t > 1)
    {"width": 640, "height": 480}
    {"grid": [2, 16, 24]}
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import attrs

from encgraph.cli.geometry import TowerGeometry
from encgraph.errors import InputError
from encgraph.packing import ItemSpec

__all__ = ["SizedItem", "parse_item", "parse_items"]

_IMAGE = re.compile(r"^(\d+)\s*[xX]\s*(\d+)$")
_GRID = re.compile(r"^(\d+)\s*,\s*(\d+)\s*,\s*(\d+)$")
_FORMS = "'WxH' (image pixels), 't,h,w' (patch grid), or a JSON object {\"width\":..,\"height\":..} / {\"grid\":[t,h,w]}"


@attrs.frozen
class SizedItem:
    """One parsed item.

    Attributes:
        source: the text it came from (``file:line``) for messages.
        grid: the patch grid ``(t, h, w)``.
        pixels: the given image size ``(width, height)``, or ``None`` for a grid.
        resized: the processor's resized ``(width, height)``, or ``None`` for a grid.
        tokens: output tokens after the merger.
    """

    source: str
    grid: tuple[int, int, int]
    pixels: tuple[int, int] | None
    resized: tuple[int, int] | None
    tokens: int

    @property
    def kind(self) -> str:
        return "video" if self.grid[0] > 1 else "image"

    @property
    def label(self) -> str:
        """A short human description: ``640x480 -> 644x476`` or ``grid 2,16,24``."""
        if self.pixels is None:
            return "grid " + ",".join(map(str, self.grid))
        (w, h), (rw, rh) = self.pixels, self.resized or self.pixels
        return f"{w}x{h}" if (w, h) == (rw, rh) else f"{w}x{h} -> {rw}x{rh}"

    def spec(self) -> ItemSpec:
        """The planner's view: tokens, frames (one attention sequence per temporal patch), patch rows."""
        t, h, w = self.grid
        return ItemSpec(self.tokens, frames=t, input_size=t * h * w)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "pixels": list(self.pixels) if self.pixels else None,
            "resized": list(self.resized) if self.resized else None,
            "grid": list(self.grid),
            "tokens": self.tokens,
            "frames": self.grid[0],
        }


def parse_items(lines: Iterable[str], geometry: TowerGeometry, *, name: str = "<stdin>") -> list[SizedItem]:
    """Parse item lines for ``geometry``.

    Raises:
        InputError: a line is in none of the accepted forms, or gives an impossible size; the message names
            ``name:line``.
    """
    items = []
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{name}:{number}"
        items.append(parse_item(text, geometry, where))
    return items


def parse_item(text: str, geometry: TowerGeometry, where: str) -> SizedItem:
    """One item (a stripped, non-comment line or a JSON request's entry) for ``geometry``.

    Raises:
        InputError: ``text`` is in none of the accepted forms, or gives an impossible size; the message starts
            with ``where``.
    """
    if text.startswith("{"):
        return _parse_json(text, geometry, where)
    if m := _IMAGE.match(text):
        return _image(int(m.group(1)), int(m.group(2)), geometry, where)
    if m := _GRID.match(text):
        return _grid((int(m.group(1)), int(m.group(2)), int(m.group(3))), geometry, where)
    raise InputError(f"{where}: expected {_FORMS}, got {text[:60]!r}.")


def _parse_json(text: str, geometry: TowerGeometry, where: str) -> SizedItem:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); expected {_FORMS}.") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}; expected {_FORMS}.")
    if "grid" in obj:
        grid = obj["grid"]
        if not (isinstance(grid, list) and len(grid) == 3 and all(_is_int(v) for v in grid)):
            raise InputError(f"{where}: \"grid\" must be a list of three ints [t, h, w], got {grid!r}.")
        return _grid(tuple(grid), geometry, where)  # type: ignore[arg-type]
    if "width" in obj and "height" in obj:
        w, h = obj["width"], obj["height"]
        if not (_is_int(w) and _is_int(h)):
            raise InputError(f"{where}: \"width\" and \"height\" must be ints, got {w!r} and {h!r}.")
        return _image(w, h, geometry, where)
    raise InputError(f"{where}: expected the keys \"width\" and \"height\", or \"grid\", got {sorted(obj)}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _image(width: int, height: int, geometry: TowerGeometry, where: str) -> SizedItem:
    if width < 1 or height < 1:
        raise InputError(f"{where}: expected a positive width and height, got {width}x{height}.")
    try:
        grid, resized = geometry.image_grid(width, height)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    return SizedItem(where, grid, (width, height), resized, geometry.tokens(grid))


def _grid(grid: tuple[int, int, int], geometry: TowerGeometry, where: str) -> SizedItem:
    geometry.check_grid(grid, where)
    return SizedItem(where, grid, None, None, geometry.tokens(grid))
