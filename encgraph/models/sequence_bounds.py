"""The host's view of an eager forward's attention sequences: :func:`host_bounds` and what it carries.

An eager forward (never a captured or compiled one) computes its ``cu_seqlens`` on the host before copying them to
the device. Inside :func:`host_bounds` the packed attention of :mod:`encgraph.models.attention` finds those host
values by the device tensor's storage, and with them, per head geometry, from how many rows a sequence runs on
dense SDPA instead of Flash varlen (:data:`RowsTable`, measured per device by
:mod:`encgraph.models.kernel_choice`), all without reading the device. The context is a ``ContextVar``: each
thread and task sees only its own block. Which long sequences run dense at a length this thread meets for the
first time is rent-or-buy (:class:`~encgraph.packing.kernels.DenseRule`, :data:`LEDGER`): the dense kernel's
first call at a new length builds a plan (about 35 ms on an H200), which pays only where dense saves more.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from encgraph.packing.kernels import LEDGER, DenseRule, PlanBuild

__all__ = ["LEDGER", "RowsTable", "dense_flags", "eager_surcharge_ms", "host_bounds", "ledger_key", "lookup",
           "rent_replayed", "segment_rule"]

log = logging.getLogger("encgraph")

RowsTable = Mapping[tuple[int, int, torch.dtype], "DenseRule | int | None"]
"""``{(heads, head_dim, dtype): rule}``: per head geometry, which sequences run dense, as measured for one device
(:func:`encgraph.models.kernel_choice.rows_table`); a bare int is a rule of those rows with no plan cost (every
sequence from there runs dense), ``None`` never."""


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
    head_dim, dtype)]`` rows (measured per device; ``attention.SEGMENT_MIN_ROWS`` for a geometry not in it, with a
    log line) then runs as one dense SDPA call, the shorter ones between them as one Flash varlen call per run; on
    the CPU every sequence is one SDPA call. Never used inside a CUDA graph capture or a compiled trace. The
    tensors must stay alive for the block (they are matched by storage)."""
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


def segment_rule(query: torch.Tensor, table: RowsTable | None, default: int) -> DenseRule:
    """The dense rule of ``query``'s head geometry and dtype: the table's, else ``default`` rows with no plan cost
    (logged once per geometry)."""
    key = (int(query.shape[1]), int(query.shape[2]), query.dtype)
    if table is not None and key in table:
        rule = table[key]
        return rule if isinstance(rule, DenseRule) else DenseRule(rule)
    if key not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add(key)
        log.info("encgraph: no kernel crossover measured for %d heads x %d (%s) on this device; eager forwards run "
                 "sequences of %d rows or more as dense SDPA calls (the H200's value; capture() measures it).",
                 key[0], key[1], str(key[2]).replace("torch.", ""), default)
    return DenseRule(default)


def ledger_key(heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, *, replayed: bool = False
               ) -> tuple[Any, ...]:
    """:data:`LEDGER`'s key of a head geometry on a device (``cuda:<index>``: plans are per device); ``replayed``:
    of the calls between piecewise segments (:attr:`DenseRule.replayed`), kept apart from an eager forward's: they
    read contiguous static tensors where an eager forward's read the tower's own views, whose strides cuDNN keys
    another plan by."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (int(heads), int(head_dim), str(dtype), str(device))
    return (*key, "replayed") if replayed else key


def dense_flags(query: torch.Tensor, bounds: Sequence[int], rule: DenseRule,
                builder: Callable[[], PlanBuild] | None = None) -> tuple[int, ...]:
    """Per sequence of ``bounds``, the rows it runs dense at in this call (its run length,
    :meth:`~encgraph.packing.kernels.DenseRule.run_rows`: its own rows or its bucket's; while its own length rents,
    the bucket it stands in at), 0 where it runs varlen (:data:`LEDGER`'s rent-or-buy,
    :meth:`~encgraph.packing.kernels.PlanLedger.run_length`, keyed by ``query``'s geometry, dtype and device).
    ``builder``: what builds this call's plans later where a purchase falls due (inside
    :meth:`~encgraph.packing.kernels.PlanLedger.deferring`: :func:`encgraph.models.dense_plans.plan_build`)."""
    key = ledger_key(query.shape[1], query.shape[2], query.dtype, query.device, replayed=rule.replayed)
    return tuple(LEDGER.run_length(key, b - a, rule, builder) for a, b in zip(bounds[:-1], bounds[1:]))


def _rents(device: torch.device) -> bool:
    """Whether eager forwards on ``device`` consult the ledger: only CUDA runs the varlen kernel."""
    return device.type == "cuda"


def _rules(table: RowsTable | None, device: torch.device) -> list[tuple[tuple[Any, ...], DenseRule]]:
    """``(ledger key, rule)`` of each head geometry of ``table`` with a rent-or-buy rule; none off CUDA (every
    sequence runs on its own there: nothing rents) or without a table."""
    if table is None or not _rents(device):
        return []
    return [(ledger_key(heads, head_dim, dtype, device), rule)
            for (heads, head_dim, dtype), rule in table.items() if isinstance(rule, DenseRule)]


def eager_surcharge_ms(table: RowsTable | None, device: torch.device, rows: Sequence[int]) -> float:
    """What an eager forward on ``device`` whose full-attention sequences have ``rows`` rows (in order) would lose
    to rent against its steady kernels, over every head geometry of ``table``
    (:meth:`~encgraph.packing.kernels.PlanLedger.surcharge_ms`; this thread's ledger, unchanged)."""
    return sum((LEDGER.surcharge_ms(key, rows, rule) for key, rule in _rules(table, device)), 0.0)


def rent_replayed(table: RowsTable | None, device: torch.device, rows: Sequence[int]) -> int:
    """Record a replay run in place of an eager forward that would have rented (the same sequences): their
    lengths' rent grows as that forward's would (:meth:`~encgraph.packing.kernels.PlanLedger.rent`). Returns the
    calls rented."""
    return sum(LEDGER.rent(key, rows, rule) for key, rule in _rules(table, device))
