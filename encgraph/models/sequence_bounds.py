"""The host's view of an eager forward's attention sequences: :func:`host_bounds` and what it carries.

An eager forward (never a captured or compiled one) computes its ``cu_seqlens`` on the host before copying them to
the device. Inside :func:`host_bounds` the packed attention of :mod:`encgraph.models.attention` finds those host
values by the device tensor's storage, and with them, per head geometry, from how many rows a sequence runs on
dense SDPA instead of the varlen kernel (:data:`RowsTable`, measured per device by
:mod:`encgraph.models.kernel_choice`), all without reading the device. The context is a ``ContextVar``: each
thread and task sees only its own block.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Mapping, Sequence

import torch

__all__ = ["RowsTable", "dense_rows", "host_bounds", "lookup"]

log = logging.getLogger("encgraph")

RowsTable = Mapping[tuple[int, int, torch.dtype], "int | None"]
"""``{(heads, head_dim, dtype): rows}``: per head geometry, from how many rows a sequence of an eager forward runs
dense (:func:`encgraph.models.kernel_choice.rows_table`), ``None``: never."""


_HOST_BOUNDS: contextvars.ContextVar[tuple[dict[tuple[int, int], tuple[int, ...]], RowsTable | None] | None] = (
    contextvars.ContextVar("encgraph_host_bounds", default=None)
)
_FALLBACK_LOGGED: set[tuple[int, int, torch.dtype]] = set()


@contextlib.contextmanager
def host_bounds(
    pairs: Sequence[tuple[torch.Tensor, Sequence[int]]], *, min_rows: RowsTable | None = None
) -> Iterator[None]:
    """Inside the block, :func:`~encgraph.models.attention.packed_attention` called (eagerly, with its default
    backend) with one of these ``cu_seqlens`` tensors knows its bounds without reading the device: ``pairs`` of
    ``(cu_seqlens tensor, the same values on the host)``. On CUDA each sequence of at least ``min_rows[(heads,
    head_dim, dtype)]`` rows (:func:`dense_rows`) then runs as one dense SDPA call, the shorter ones between them
    as one varlen call per run; on the CPU every sequence is one SDPA call. Never used inside a CUDA graph capture
    or a compiled trace. The tensors must stay alive for the block (they are matched by storage)."""
    mapping = {(t.data_ptr(), t.numel()): tuple(int(x) for x in b) for t, b in pairs}
    token = _HOST_BOUNDS.set((mapping, min_rows))
    try:
        yield
    finally:
        _HOST_BOUNDS.reset(token)


def lookup(cu_seqlens: torch.Tensor) -> tuple[tuple[int, ...], RowsTable | None] | None:
    """``(host bounds, rows table)`` of ``cu_seqlens`` inside :func:`host_bounds`; ``None`` outside it, for another
    tensor, while compiling or while a CUDA graph captures."""
    if torch.compiler.is_compiling():
        # First: dynamo cannot trace ContextVar.get (a graph break in every attention layer of a compiled region).
        return None
    context = _HOST_BOUNDS.get()
    if not context:
        return None
    bounds = context[0].get((cu_seqlens.data_ptr(), cu_seqlens.numel()))
    if bounds is None or (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    return bounds, context[1]


def dense_rows(query: torch.Tensor, table: RowsTable | None, default: int) -> int | None:
    """From how many rows a sequence of ``query``'s head geometry and dtype runs dense: the table's, else
    ``default`` (logged once per geometry); ``None``: never."""
    key = (int(query.shape[1]), int(query.shape[2]), query.dtype)
    if table is not None and key in table:
        return table[key]
    if key not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add(key)
        log.info("encgraph: no kernel crossover measured for %d heads x %d (%s) on this device; eager forwards run "
                 "sequences of %d rows or more as dense SDPA calls (capture() measures it).",
                 key[0], key[1], str(key[2]).replace("torch.", ""), default)
    return default
