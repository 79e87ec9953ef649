"""A module call's arguments split into its batch-first tensors and everything else, for the any-module path.

:func:`split_call` walks ``(args, kwargs)`` (tuples, named tuples, lists and dicts, to any depth) and returns a
:class:`CallSplit`: the tensors in order, their common batch size (dim 0), and a hashable ``key`` that holds the
structure, every tensor's trailing shape, dtype and device, and every other argument's value (``True``, ``None``,
an int, a string, any hashable object). Two calls with equal keys differ only in their tensors' values and batch
size: one set of graphs serves both, and :func:`rebuild` puts tensors of that shape back into the same call.

A call that cannot be batched this way (no tensor, a 0-dim tensor, tensors that differ in dim 0, an unhashable
argument) gets a reason instead, and the module's own forward answers it.

Cost: a few microseconds for the usual call (one tensor and a few flags); kwargs are keyed in sorted order, so
the order a caller writes them in does not make another shape.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

__all__ = ["CallSplit", "split_call", "rebuild", "describe_key"]

_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)


class _Unbatchable(Exception):
    pass


@attrs.frozen(eq=False)
class CallSplit:
    """A call's tensors (``tensors``, each ``(batch, ...)``), their ``batch`` size and its shape ``key``."""

    key: tuple[Any, ...]
    tensors: tuple[torch.Tensor, ...]
    batch: int


def _freeze(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise _Unbatchable("a 0-dim tensor argument")
        tensors.append(value)
        return ("T", tuple(value.shape[1:]), value.dtype, value.device)
    if isinstance(value, _CONSTANTS):
        return ("C", type(value), value)
    if isinstance(value, tuple):
        return ("tuple", type(value), tuple(_freeze(v, tensors) for v in value))
    if isinstance(value, list):
        return ("list", tuple(_freeze(v, tensors) for v in value))
    if isinstance(value, dict):
        return ("dict", type(value), tuple((k, _freeze(v, tensors)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        raise _Unbatchable(f"an argument of type {type(value).__name__} (not hashable)") from None
    return ("C", type(value), value)


def split_call(args: Sequence[Any], kwargs: dict[str, Any]) -> CallSplit | str:
    """``(args, kwargs)`` as a :class:`CallSplit`, or the reason it cannot be batched (a short phrase)."""
    tensors: list[torch.Tensor] = []
    try:
        key = (
            tuple(_freeze(a, tensors) for a in args),
            tuple((k, _freeze(kwargs[k], tensors)) for k in sorted(kwargs)),
        )
    except _Unbatchable as why:
        return str(why)
    if not tensors:
        return "no tensor argument"
    batch = tensors[0].shape[0]
    if any(t.shape[0] != batch for t in tensors):
        return "tensor arguments differ in dim 0"
    return CallSplit(key, tuple(tensors), int(batch))


def _thaw(frozen: Any, tensors: Iterator[torch.Tensor]) -> Any:
    kind = frozen[0]
    if kind == "T":
        return next(tensors)
    if kind == "C":
        return frozen[2]
    if kind == "tuple":
        items = [_thaw(v, tensors) for v in frozen[2]]
        cls = frozen[1]
        if cls is tuple:
            return tuple(items)
        return cls(*items) if hasattr(cls, "_fields") else cls(items)
    if kind == "list":
        return [_thaw(v, tensors) for v in frozen[1]]
    return frozen[1]((k, _thaw(v, tensors)) for k, v in frozen[2])


def rebuild(key: tuple[Any, ...], tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call ``(args, kwargs)`` of shape ``key`` with ``tensors`` in its tensors' places, in order."""
    it = iter(tensors)
    args = tuple(_thaw(a, it) for a in key[0])
    kwargs = {k: _thaw(v, it) for k, v in key[1]}
    return args, kwargs


def describe_key(key: tuple[Any, ...]) -> str:
    """A short line for logs and stats: each tensor's trailing shape and dtype, and the other arguments."""
    parts: list[str] = []

    def walk(frozen: Any, name: str) -> None:
        kind = frozen[0]
        if kind == "T":
            dtype = str(frozen[2]).removeprefix("torch.")
            parts.append(f"{name}(B, {', '.join(map(str, frozen[1]))}) {dtype}".replace("(B, )", "(B,)"))
        elif kind == "C":
            if frozen[2] is not None:
                parts.append(f"{name}={frozen[2]!r}")
        else:
            children = frozen[2] if kind in ("tuple", "dict") else frozen[1]
            for i, child in enumerate(children):
                if kind == "dict":
                    walk(child[1], f"{name}[{child[0]!r}]")
                else:
                    walk(child, f"{name}[{i}]")

    for i, a in enumerate(key[0]):
        walk(a, f"arg{i}")
    for k, v in key[1]:
        walk(v, k)
    return ", ".join(parts)
