"""Checks on user input, in one place, raising clear errors (never ``assert``).

Pure Python: imported by the torch-free planner (:func:`check_pixels`, for the adapters, imports torch when
called).  Each helper names the argument, what was expected, what was given, and how to fix it (the ``hint``).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from encgraph.errors import ConfigError, ConfigTypeError, InputError, InputTypeError

__all__ = [
    "check_int",
    "check_positive_int",
    "check_nonneg_int",
    "check_optional_int",
    "check_str",
    "check_path",
    "check_iterable",
    "check_mapping",
    "check_sequence",
    "check_padded_images",
    "check_pixels",
    "describe",
]


def describe(value: Any) -> str:
    """A short description of ``value`` for error messages: its repr (cut) and its type."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _tail(hint: str) -> str:
    return f" {hint}" if hint else ""


def check_int(name: str, value: Any, *, minimum: int | None = None, hint: str = "") -> int:
    """Return ``value`` as an ``int`` if it is an integer (not a bool) at least ``minimum``; raise otherwise.

    >>> check_int("max_items", 4, minimum=1)
    4
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigTypeError(f"{name}: expected an int, got {describe(value)}.{_tail(hint)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}: expected an int >= {minimum}, got {value}.{_tail(hint)}")
    return value


def check_positive_int(name: str, value: Any, *, hint: str = "") -> int:
    return check_int(name, value, minimum=1, hint=hint)


def check_nonneg_int(name: str, value: Any, *, hint: str = "") -> int:
    return check_int(name, value, minimum=0, hint=hint)


def check_optional_int(name: str, value: Any, *, minimum: int | None = None, hint: str = "") -> int | None:
    """``None`` passes through; anything else must be an int at least ``minimum``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigTypeError(f"{name}: expected an int or None, got {describe(value)}.{_tail(hint)}")
    return check_int(name, value, minimum=minimum, hint=hint)


def check_str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigTypeError(f"{name}: expected a non-empty str, got {describe(value)}.")
    return value


def check_path(name: str, value: Any) -> str:
    """A path name: a non-empty ``str`` (type errors raise ``ConfigTypeError``, ``""`` raises ``ConfigError``)."""
    if not isinstance(value, str):
        raise ConfigTypeError(
            f"{name}: expected a path name (str), got {describe(value)}. Name each path with a str such as "
            f"'default', 'global' or 'local'."
        )
    if not value:
        raise ConfigError(f"{name}: expected a non-empty path name, got ''. Give the path a name such as 'default'.")
    return value


def check_iterable(name: str, value: Any, *, hint: str = "") -> Iterable[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigTypeError(f"{name}: expected an iterable, got {describe(value)}.{_tail(hint)}")
    return value


def check_mapping(name: str, value: Any, *, hint: str = "") -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise ConfigTypeError(f"{name}: expected a mapping (dict), got {describe(value)}.{_tail(hint)}")
    return value


def check_sequence(name: str, value: Any, *, hint: str = "") -> Sequence[Any]:
    """A sized, indexable sequence (list, tuple, range), not a str/bytes and not a one-shot iterator."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigTypeError(
            f"{name}: expected a sequence (list or tuple), got {describe(value)}.{_tail(hint)}"
        )
    return value


def check_padded_images(value: Any, *, channels: int, device: Any, min_side: int = 1) -> Any:
    """:func:`check_pixels` of ``pixel_values`` as zero-padded images ``(images, channels, H, W)`` (at least one
    image, both sides at least ``min_side`` px), the processor's normalised floating-point images: Pixtral's and
    Idefics3's calls."""
    least = f" of at least one {min_side} px patch a side" if min_side > 1 else ""

    def padded(pv: Any) -> str | None:
        if pv.dim() == 4 and pv.shape[1] == channels and pv.shape[0] > 0 and min(pv.shape[2:]) >= min_side:
            return None
        return (f"pixel_values: expected shape (images, {channels}, height, width) (zero-padded images{least}, as "
                f"the processor gives them), got {tuple(pv.shape)}.")

    return check_pixels("pixel_values", value, expected=f"a torch.Tensor (images, {channels}, H, W)",
                        floating="a floating-point tensor (the processor's normalised images)", device=device,
                        shape=padded)


def check_pixels(
    name: str, value: Any, *, expected: str, floating: str, device: Any, shape: Callable[[Any], str | None],
    owner: str = "tower", dtype_fix: str = "",
) -> Any:
    """An adapter's pixel input ``value`` (the argument ``name``), returned once checked, in this order:

    - a tensor, else ``InputTypeError``: "``name``: expected ``expected``, got ...";
    - floating point, else ``InputTypeError``: "``name``: expected ``floating``, got <dtype>``dtype_fix``.";
    - of a shape the graphs take: ``shape(value)`` is the ``InputError`` message, ``None`` when it fits;
    - on ``device``, else ``InputError`` naming where the ``owner`` (tower or model) is and the ``.to()`` that
      moves it there.
    """
    import torch

    if not isinstance(value, torch.Tensor):
        raise InputTypeError(f"{name}: expected {expected}, got {describe(value)}.")
    if not value.is_floating_point():
        raise InputTypeError(f"{name}: expected {floating}, got {value.dtype}{dtype_fix}.")
    problem = shape(value)
    if problem is not None:
        raise InputError(problem)
    if value.device != device:
        raise InputError(
            f"{name}: expected a tensor on {device} (where the {owner} is), got {value.device}; move it with "
            f".to({str(device)!r})."
        )
    return value
