"""Item specs: what the planner needs to know about one image or video."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import attrs

from encgraph._validate import check_int, check_optional_int, check_path, describe
from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing.ladder import DEFAULT_PATH

__all__ = ["ItemSpec"]

_TOKENS_HINT = "Pass an int (one path, 'default') or {path: int} with one entry per path of the encoder."


def _to_tokens(value: Any) -> dict[str, int]:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return {DEFAULT_PATH: check_int("ItemSpec(tokens)", value, minimum=1, hint="An item has at least one token.")}
    if not isinstance(value, Mapping):
        raise ConfigTypeError(f"ItemSpec(tokens): expected an int or a mapping {{path: int}}, got {describe(value)}. {_TOKENS_HINT}")
    if not value:
        raise ConfigError(f"ItemSpec(tokens): expected at least one path, got an empty mapping. {_TOKENS_HINT}")
    out: dict[str, int] = {}
    for path in sorted(value, key=lambda p: (not isinstance(p, str), str(p))):
        check_path("ItemSpec(tokens) path name", path)
        out[path] = check_int(
            f"ItemSpec(tokens[{path!r}])", value[path], minimum=0, hint="Token counts are >= 0 (0: nothing on that path)."
        )
    if not any(out.values()):
        raise ConfigError(
            f"ItemSpec(tokens): expected at least one token in total, got {out}. An item with no tokens has "
            f"nothing to encode: drop it before planning."
        )
    return out


def _check_frames(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_int("ItemSpec(frames)", value, minimum=1, hint="An image has 1 frame; a video has its temporal grid size.")


def _check_input_size(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_optional_int("ItemSpec(input_size)", value, minimum=0, hint="Use None when unknown, or the patch-row count.")


@attrs.frozen
class ItemSpec:
    """One item (an image or a video) as the planner sees it.

    Attributes:
        tokens: output tokens per path, ``{path: int}`` (an ``int`` argument means ``{"default": int}``); every
            count >= 0 and at least one token in total.  Stored with the paths sorted by name.
        frames: attention sequences the item adds (1 for an image, the temporal grid size for a video), >= 1.
        input_size: input rows (patches) the item feeds the encoder, or ``None`` when not needed.

    Validation happens here, once, so that :func:`pack` can trust its items.

    >>> spec = ItemSpec(256)
    >>> spec.tokens, spec.total_tokens, spec.paths
    ({'default': 256}, 256, ('default',))
    >>> two = ItemSpec({"local": 576, "global": 256}, frames=1)
    >>> two.tokens, two.total_tokens
    ({'global': 256, 'local': 576}, 832)
    """

    tokens: dict[str, int] = attrs.field(converter=_to_tokens, hash=False)
    frames: int = attrs.field(default=1, kw_only=True, validator=_check_frames)
    input_size: int | None = attrs.field(default=None, kw_only=True, validator=_check_input_size)
    _paths: tuple[str, ...] = attrs.field(init=False, eq=False, repr=False, hash=False)
    _values: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False, hash=False)
    _total: int = attrs.field(init=False, eq=False, repr=False, hash=False)

    def __attrs_post_init__(self) -> None:
        # Cached so that pack() reads plain tuples and ints in its hot loop.
        object.__setattr__(self, "_paths", tuple(self.tokens))
        object.__setattr__(self, "_values", tuple(self.tokens.values()))
        object.__setattr__(self, "_total", sum(self._values))

    def __hash__(self) -> int:
        return hash((self._paths, self._values, self.frames, self.input_size))

    @property
    def total_tokens(self) -> int:
        """Tokens over all paths."""
        return self._total

    @property
    def paths(self) -> tuple[str, ...]:
        """The item's path names, sorted."""
        return self._paths
