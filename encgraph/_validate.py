"""Checks on user input, in one place, raising clear errors (never ``assert``).

Pure Python: imported by the torch-free planner.  Each helper names the argument, what was expected, what was
given, and how to fix it.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

from encgraph.errors import ConfigError, ConfigTypeError

__all__ = ["check_int", "check_positive_int", "check_nonneg_int", "check_str", "describe"]


def describe(value: Any) -> str:
    """A short description of ``value`` for error messages: its repr (cut) and its type."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def check_int(name: str, value: Any, *, minimum: int | None = None, hint: str = "") -> int:
    """Return ``value`` as an ``int`` if it is an integer (not a bool) at least ``minimum``; raise otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigTypeError(f"{name}: expected an int, got {describe(value)}.{' ' + hint if hint else ''}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}: expected an int >= {minimum}, got {value}.{' ' + hint if hint else ''}")
    return value


def check_positive_int(name: str, value: Any, *, hint: str = "") -> int:
    return check_int(name, value, minimum=1, hint=hint)


def check_nonneg_int(name: str, value: Any, *, hint: str = "") -> int:
    return check_int(name, value, minimum=0, hint=hint)


def check_str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigTypeError(f"{name}: expected a non-empty str, got {describe(value)}.")
    return value


def check_iterable(name: str, value: Any) -> Iterable[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigTypeError(f"{name}: expected an iterable, got {describe(value)}.")
    return value
