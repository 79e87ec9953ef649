"""A batch ladder for towers whose inputs are batch-first tensors of one known shape (the fixed-resolution Hugging
Face towers build on it: :mod:`encgraph.models.fixed`), and the row helpers every adapter shares.

:class:`BatchLadderAdapter`: the budget unit is items, the ladder one of batch sizes, each positional input a
zero-filled static buffer ``arg<i>`` of shape ``(budget, *trailing)``; a subclass sets ``_signature`` (the trailing
shapes, dtypes and output names) at construction. Modules of unknown shape go through
:mod:`encgraph.models.generic` instead, which learns each call shape from the module's own answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from encgraph._validate import check_int, describe
from encgraph.capture.protocol import AdapterConfig, BudgetUnit, BufferSpec, FillRule, PathSpec
from encgraph.capture.upload import to_device
from encgraph.errors import ConfigError, InputError, InputTypeError
from encgraph.packing import ItemSpec

__all__ = ["BatchLadderAdapter", "Signature", "concat_parts", "take_rows", "ONE_ITEM"]

PATH = "default"
ONE_ITEM = ItemSpec(1)
"""The spec of one image (or row) of a batch ladder: every item's, shared (specs are immutable)."""


def concat_parts(parts: Sequence[Any], kind: type | tuple[type, ...]) -> list[Any]:
    """The ``parts`` of an adapter's ``concat`` as a list, checked to be non-empty and of ``kind``."""
    if not isinstance(parts, (list, tuple)) or not parts:
        raise InputError(f"concat: expected a non-empty list of inputs, got {describe(parts)}.")
    parts = list(parts)
    for i, part in enumerate(parts):
        if not isinstance(part, kind):
            raise InputTypeError(f"concat: parts[{i}]: expected {describe_kind(kind)}, got {describe(part)}.")
    return parts


def take_rows(t: torch.Tensor, rows: Sequence[int] | np.ndarray) -> torch.Tensor:
    """Rows ``rows`` of ``t`` (dim 0), in that order, without making the host wait for the device: a view of ``t``
    when they are one ascending run (a sub-batch of consecutive items, the usual case), else ``index_select`` with
    the index built on the host and copied to ``t``'s device from pinned memory without blocking (a copy from
    pageable memory, ``torch.as_tensor(rows, device=...)``, waits for the stream's queued work: the previous
    replay). Lifetime: a view shares ``t``'s storage; the host allocator keeps the pinned index until its copy is
    done."""
    if isinstance(rows, (tuple, list, range)):  # a plan's items: checked in Python, no arrays for the usual run
        if not rows:
            return t[:0]
        start = rows[0]
        if start >= 0 and all(b - a == 1 for a, b in zip(rows, rows[1:])):
            return t[start : start + len(rows)]
    index = np.asarray(rows, dtype=np.int64).reshape(-1)
    n = index.size
    start = int(index[0]) if n else 0
    if n == 0 or (start >= 0 and np.array_equal(index, np.arange(start, start + n))):
        return t[start : start + n]
    return t.index_select(0, to_device(torch.from_numpy(index), t.device))


def describe_kind(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


@attrs.frozen
class Signature:
    """Trailing shapes and dtypes of the positional inputs; the output's structure ("tensor", "tuple",
    "list" or "dict") and names."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    kind: str
    names: tuple[str, ...]
    cls: type | None = None


class BatchLadderAdapter:
    """Base of the adapters whose items are rows of batch-first input tensors of a known shape.

    Subclasses set ``self._signature`` (a :class:`Signature`) in their constructor and parse calls themselves
    (``inputs_from_call``, ``item_specs``); this base gives the ladder, the buffers, both forwards over the
    positional inputs, and row selection.

    Args:
        module: the module; its parameters' device and dtype are the tower's.
        max_batch: the largest batch size captured (default 32); the default ladder is 1, 2, 4, ... up to it.
    """

    def __init__(self, module: torch.nn.Module, *, max_batch: int = 32) -> None:
        if not isinstance(module, torch.nn.Module):
            raise InputTypeError(f"module: expected a torch.nn.Module, got {describe(module)}.")
        self._module = module
        self.max_batch = check_int("max_batch", max_batch, minimum=1)
        param = next(iter(module.parameters()), None)
        self._device = param.device if param is not None else torch.device("cpu")
        self._dtype = param.dtype if param is not None else torch.float32
        self._signature: Signature | None = None
        self._not_batch_first: str | None = None

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    @property
    def config(self) -> AdapterConfig:
        # Built again only when the signature the outputs are named from changes (it is learned on a first call);
        # every call of the runner reads it.
        cached = self.__dict__.get("_config_of")
        if cached is None or cached[0] is not self._signature:
            names = self._signature.names if self._signature is not None else ("out",)
            config = AdapterConfig(
                paths=PathSpec(PATH, 1, self.max_batch, outputs=names, unit=BudgetUnit.ITEMS),
                dtype=self._dtype,
                device=self._device,
            )
            cached = self.__dict__["_config_of"] = (self._signature, config)
        return cached[1]

    @property
    def stock_reason(self) -> str | None:
        """Why every call is answered by the module's own forward (the self-check found rows mixing), or None."""
        return self._not_batch_first

    def selfcheck_failed(self, path: str, budget: int, reason: str) -> bool:
        """The runner's self-check found a padded forward off the eager one: rows mix across the batch (or the
        padded batch computes otherwise), so no padded batch can stand in for the module; every budget goes
        (returns True) and ``encgraph.graphed`` answers every call with the module's own forward."""
        self._not_batch_first = "padded batch differs from the module's forward (self-check)"
        return True

    def select(self, inputs: tuple[torch.Tensor, ...], indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
        return tuple(take_rows(t, indices) for t in inputs)

    # -- static buffers and forwards
    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> dict[str, BufferSpec]:
        sig = self._require_signature()
        return {
            f"arg{i}": BufferSpec((budget, *shape), dtype, FillRule.ZERO)
            for i, (shape, dtype) in enumerate(zip(sig.shapes, sig.dtypes))
        }

    def replay_values(self, path: str, inputs: tuple[torch.Tensor, ...], budget: int) -> dict[str, torch.Tensor]:
        return {f"arg{i}": t for i, t in enumerate(inputs)}

    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return dict(parts[PATH])

    def unwrap(self) -> torch.nn.Module:
        return self._module

    def _require_signature(self) -> Signature:
        if self._signature is None:
            raise ConfigError(f"{type(self).__name__}: input shapes are unknown (the subclass sets them).")
        return self._signature


