"""Per-batch limits (items and frames) and the one function that derives their defaults from the ladders."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from encgraph._validate import check_int, check_optional_int
from encgraph.errors import ConfigError
from encgraph.packing.ladder import normalize_ladders

__all__ = ["DEFAULT_MAX_ITEMS", "Limits", "default_limits", "check_limits"]

DEFAULT_MAX_ITEMS = 16
"""The default ``max_items`` (fewer where the smallest budget has fewer tokens).

Why not fewer: a ladder's ``b_max // b_min``, the rule before, gave a one-budget ladder ``max_items=1`` and a
``(1024, 2048)`` ladder 2, so every small image replayed alone in a large graph (measured on the H200: eight
400-patch Qwen3-VL images in eight replays of a 3136-patch graph took 116 ms, where one replay of all eight takes
about 15).

Why not more: the captured varlen attention call has ``max_frames + 2`` ``cu_seqlens`` slots and ``max_seqlen``
equal to the budget's rows, and torch's Flash kernel launches row blocks x slots x heads thread blocks whether a
slot holds a sequence or not.  The same rule gave a 64..4096 ladder 64 items (130 slots with 2 frames per item):
replayed on the H200 (``benches/results/varlen_slots_nvidia-h200.md``), one 3,136-row sequence in a 3,584-row
budget took 0.350 ms a layer at 130 slots, 0.288 at 34 and 0.266 at 3 (Qwen3-VL's 16 heads x 72); 1.56x the
3-slot time at 1,024 rows and 1.06x at 16,384.  Two chat-trace runs of Qwen3-VL on the H200, minutes apart,
64 items then 16: defaults mean 32.3 then 30.9 ms, P99 103 ms both."""


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_int(f"Limits({attribute.name})", value, minimum=1)


@attrs.frozen
class Limits:
    """How much one batch may hold besides tokens.

    Attributes:
        max_items: most items (images or videos) in one batch; sizes the per-item metadata buffers.
        max_frames: most frames (attention sequences: 1 per image, temporal grid size per video) in one
            batch; sizes the captured ``cu_seqlens`` buffer.  Always >= ``max_items``.

    >>> Limits(max_items=4, max_frames=8)
    Limits(max_items=4, max_frames=8)
    """

    max_items: int = attrs.field(validator=_positive)
    max_frames: int = attrs.field(validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.max_frames < self.max_items:
            raise ConfigError(
                f"Limits: expected max_frames >= max_items (every item has at least one frame), got "
                f"max_items={self.max_items}, max_frames={self.max_frames}. Raise max_frames to at least "
                f"{self.max_items} or lower max_items."
            )


def _fast_limits(max_items: int, max_frames: int) -> Limits:
    # For values check_limits() has already validated.
    lim = object.__new__(Limits)
    object.__setattr__(lim, "max_items", max_items)
    object.__setattr__(lim, "max_frames", max_frames)
    return lim


def _smallest_nonzero(ladders: Mapping[str, tuple[int, ...]]) -> tuple[str, int]:
    best_path, best = "", 0
    for path, ladder in ladders.items():
        b = ladder[1] if ladder[0] == 0 else ladder[0]
        if not best or b < best:
            best_path, best = path, b
    return best_path, best


def check_limits(
    ladders: Mapping[str, tuple[int, ...]] | None, max_items: Any, max_frames: Any, *, where: str = "pack"
) -> tuple[int, int | None]:
    """Validate user limits; return ``(max_items, max_frames)``.

    ``max_items`` must be a positive int, and when ``ladders`` (normalized) are given, no larger than the
    smallest non-zero budget of any path (vLLM PR 38040: a per-item dummy of 0 tokens crashes capture);
    ``max_frames`` is ``None`` or an int >= ``max_items``.
    """
    items = check_int(
        f"{where}(max_items)", max_items, minimum=1, hint="A batch holds at least one item: use 1 or more."
    )
    frames = check_optional_int(
        f"{where}(max_frames)", max_frames, minimum=1, hint="Use None for no frame limit, or 1 or more."
    )
    if ladders is not None:
        _check_items_fit_budgets(ladders, items, where)
    if frames is not None and frames < items:
        raise ConfigError(
            f"{where}(max_frames): expected at least max_items={items} (every item has at least one frame), "
            f"got {frames}. Raise max_frames to {items} or more, or lower max_items to {frames}."
        )
    return items, frames


def _check_items_fit_budgets(ladders: Mapping[str, tuple[int, ...]], items: int, where: str) -> None:
    path, smallest = _smallest_nonzero(ladders)
    if items > smallest:
        raise ConfigError(
            f"{where}(max_items): expected at most {smallest} (the smallest non-zero budget, path {path!r}), "
            f"got {items}. More items than the smallest budget leaves some item no tokens at capture; lower "
            f"max_items to {smallest} or raise the smallest budget of {path!r}."
        )


def default_limits(
    ladders: Iterable[int] | Mapping[str, Iterable[int]],
    *,
    max_frames_per_item: int = 1,
    max_items: int | None = None,
    max_frames: int | None = None,
) -> Limits:
    """The per-batch limits for ``ladders``, from defaults and the user's values.

    Rules:

    - default ``max_items`` = :data:`DEFAULT_MAX_ITEMS`, or a path's smallest non-zero budget ``b_min`` where
      that is less: never more items than the smallest budget has tokens (vLLM PR 38040: more items than the
      smallest budget crashes capture);
    - default ``max_frames`` = ``max_items * max_frames_per_item``;
    - only ``max_items`` given: ``max_frames = max_items * max_frames_per_item``;
    - only ``max_frames`` given: ``max_items = min(default max_items, max_frames)``;
    - both given: both are used as they are.

    Raises ``ConfigError`` when ``max_items`` exceeds the smallest non-zero budget of some path, or when
    ``max_frames < max_items`` (every item has at least one frame).

    >>> default_limits((64, 128, 256, 512, 800))
    Limits(max_items=16, max_frames=16)
    >>> default_limits((64, 8192), max_frames_per_item=4)
    Limits(max_items=16, max_frames=64)
    >>> default_limits((8, 1024))
    Limits(max_items=8, max_frames=8)
    >>> default_limits((64, 800), max_items=2, max_frames_per_item=4)
    Limits(max_items=2, max_frames=8)
    >>> default_limits((64, 800), max_frames=5)
    Limits(max_items=5, max_frames=5)
    """
    norm = normalize_ladders(ladders)
    per_item = check_int(
        "default_limits(max_frames_per_item)",
        max_frames_per_item,
        minimum=1,
        hint="An image has 1 frame; a video has its temporal grid size.",
    )
    default_items = min(DEFAULT_MAX_ITEMS, *(next(b for b in ladder if b > 0) for ladder in norm.values()))
    if max_items is None and max_frames is None:
        return Limits(max_items=default_items, max_frames=default_items * per_item)
    if max_items is None:
        frames = check_int(
            "default_limits(max_frames)", max_frames, minimum=1, hint="Use None for the default, or 1 or more."
        )
        return Limits(max_items=min(default_items, frames), max_frames=frames)
    items, frames = check_limits(norm, max_items, max_frames, where="default_limits")
    return Limits(max_items=items, max_frames=items * per_item if frames is None else frames)
