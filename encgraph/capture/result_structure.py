"""A result's structure apart from its tensors, so that results travel between ranks as bytes
(:mod:`encgraph.capture.distributed`): :func:`flatten_result` splits a result into a hashable, picklable
:class:`ResultStructure` (its nesting, its leaves' dtypes and ranks) and its tensor leaves, and
:meth:`ResultStructure.rebuild` puts received leaves back in place.

Containers: ``dict`` / ``OrderedDict`` / ``list`` / ``tuple`` / named tuple / dataclass (a Hugging Face
``ModelOutput`` included), nested to any depth; anything else as a leaf raises
:class:`~encgraph.errors.ConfigTypeError` naming where it is.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from encgraph._validate import describe
from encgraph.errors import ConfigTypeError

__all__ = ["ResultStructure", "flatten_result"]


@attrs.frozen
class ResultStructure:
    """The shape-free description of one result: its nesting (``tree``) and its tensor leaves' dtypes and ranks.

    ``tree`` is a nested tuple, hashable and picklable (container types travel by reference, as pickle does):
    ``("tensor", leaf_index)``, ``("list" | "tuple", children)``, ``("namedtuple" | "dataclass", cls, fields,
    children)`` or ``("dict", cls, keys, children)``.
    """

    tree: tuple[Any, ...]
    dtypes: tuple[torch.dtype, ...]
    ndims: tuple[int, ...]

    @property
    def words(self) -> int:
        """``int64`` words of one item's meta: the structure id, then every leaf's shape."""
        return 1 + sum(self.ndims)

    def rebuild(self, leaves: Sequence[torch.Tensor]) -> Any:
        """The result with ``leaves`` (in flatten order) in place of the original tensors."""
        return _rebuild(self.tree, leaves)


def flatten_result(result: Any, where: str = "result") -> tuple[ResultStructure, list[torch.Tensor]]:
    """Split ``result`` into its :class:`ResultStructure` and its tensor leaves (depth first, in key order).

    Raises:
        ConfigTypeError: a leaf is not a tensor, or a container type cannot be rebuilt; the message names where.
    """
    leaves: list[torch.Tensor] = []
    tree = _flatten(result, leaves, where)
    return ResultStructure(tree, tuple(t.dtype for t in leaves), tuple(t.dim() for t in leaves)), leaves


def _flatten(obj: Any, leaves: list[torch.Tensor], where: str) -> tuple[Any, ...]:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return ("tensor", len(leaves) - 1)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # A Hugging Face ModelOutput is a dataclass and an OrderedDict whose keys are its non-None fields; the
        # constructor fills the others with None again.
        names = tuple(obj.keys()) if isinstance(obj, Mapping) else tuple(f.name for f in dataclasses.fields(obj))
        children = tuple(_flatten(_field(obj, n), leaves, f"{where}.{n}") for n in names)
        return ("dataclass", type(obj), names, children)
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        children = tuple(_flatten(v, leaves, f"{where}.{n}") for n, v in zip(type(obj)._fields, obj))
        return ("namedtuple", type(obj), type(obj)._fields, children)
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        children = tuple(_flatten(v, leaves, f"{where}[{i}]") for i, v in enumerate(obj))
        return (type(obj).__name__, children)
    if isinstance(obj, dict) and _rebuildable_dict(type(obj)):
        keys = tuple(obj)
        children = tuple(_flatten(obj[k], leaves, f"{where}[{k!r}]") for k in keys)
        return ("dict", type(obj), keys, children)
    raise ConfigTypeError(
        f"{where}: data-parallel gathering needs tensors nested in dict, list, tuple, named tuple or dataclass "
        f"(ModelOutput) containers, got {describe(obj)}. Make the adapter's assemble() return tensors only."
    )


def _field(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, Mapping) else getattr(obj, name)


def _rebuildable_dict(cls: type) -> bool:
    # dict, OrderedDict and subclasses that keep their __init__ rebuild from (key, value) pairs; a defaultdict
    # or a Counter would not.
    return cls.__init__ in (dict.__init__, OrderedDict.__init__)


def _rebuild(tree: tuple[Any, ...], leaves: Sequence[torch.Tensor]) -> Any:
    kind = tree[0]
    if kind == "tensor":
        return leaves[tree[1]]
    if kind == "list":
        return [_rebuild(c, leaves) for c in tree[1]]
    if kind == "tuple":
        return tuple(_rebuild(c, leaves) for c in tree[1])
    _, cls, names, children = tree
    values = [_rebuild(c, leaves) for c in children]
    if kind == "namedtuple":
        return cls(*values)
    if kind == "dataclass":
        return cls(**dict(zip(names, values)))
    return cls(zip(names, values))
