"""The dense kernel's plans that capture builds ahead, in the capturing thread: cuDNN's attention plan is built per
exact shape (about 40 ms on an H200) and kept per thread, so that a bucket length (:func:`~encgraph.packing.kernels.
bucket_rows`) built here is free to its first image of that size. Eager forwards' buckets (:data:`WARM_ROWS`) are
built when the adapter chooses its kernels (:mod:`encgraph.models.kernel_choice`); a piecewise replay's split calls'
buckets, up to the largest split budget's rows, after the split capture
(:meth:`encgraph.models.piece_attention.SplitCall.warm`). Lengths a thread holds are marked in the plan ledger
(:data:`~encgraph.packing.kernels.LEDGER`), which then runs them dense at once. A length bought while serving is
built after the call that bought it has issued its work (:func:`plan_build`,
:meth:`~encgraph.packing.kernels.PlanLedger.deferring`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch

from encgraph.models.dense_sequence import dense_sequence, padded_dense
from encgraph.models.sequence_bounds import LEDGER, RowsTable, ledger_key
from encgraph.packing.kernels import DenseRule, PlanBuild, bucket_rows

__all__ = ["WARM_ROWS", "plan_build", "warm_lengths", "warm_plans"]

log = logging.getLogger("encgraph")

WARM_ROWS = (8192, 65536)
"""The bucket lengths whose dense plans capture builds ahead, in the capturing thread (:func:`warm_plans`): 49
buckets at most (16 per octave, and 65,536), each one call of about 50 ms on an H200 (cuDNN's plan plus the
kernel), so that the first images of these sizes neither pay a plan (as the tower's own SDPA does at every new
size) nor rent varlen. 65,536 rows: Qwen's processors' largest image (16,384 tokens at merge 2); from 8,192
rows, where Flash varlen is well behind. Shorter lengths, and other threads, are bought as they come
(rent-or-buy)."""


def warm_lengths(rule: DenseRule, rows: tuple[int, int] = WARM_ROWS) -> list[int]:
    """The bucket lengths within ``rows`` (inclusive) at which ``rule`` runs dense calls: from its
    :attr:`~encgraph.packing.kernels.DenseRule.warm_from` (the crossover's bucket start, for eager or replayed
    calls, or an eager call's earlier stand-in start: :meth:`DenseRule.stand_in_rows`), and only those dense runs
    faster than varlen (:meth:`DenseRule.may_run_dense`); none where the geometry is not bucketed."""
    start = rule.warm_from
    if start is None or rule.min_rows is None:
        return []
    out, length = [], bucket_rows(max(rows[0], start, rule.min_rows))
    while length <= rows[1]:
        if rule.may_run_dense(length):
            out.append(length)
        length = bucket_rows(length + 1)
    return out


def warm_plans(table: RowsTable, device: torch.device, rows: tuple[int, int] = WARM_ROWS
               ) -> dict[str, Any]:
    """Build, in this thread, the dense plan of every bucket length :func:`warm_lengths` gives for each rule of
    ``table`` on the CUDA ``device`` (one :func:`~encgraph.models.dense_sequence.padded_dense` call each, on a
    sequence one row shorter: the call an eager forward makes, and a split call between piecewise segments), and mark them bought in this thread's
    :data:`~encgraph.packing.kernels.LEDGER` (lengths it holds already are skipped). Returns ``{"lengths": built,
    "seconds": wall time}``. Random inputs of the longest length live for the call (three ``(rows, heads,
    head_dim)`` tensors, ~150 MB each at 65,536 x 16 x 72 in bf16). Capture time only: syncs the host at the
    end."""
    start, built = time.perf_counter(), 0
    if device.type != "cuda":
        return {"lengths": 0, "seconds": 0.0}
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode(), torch.cuda.device(device):
        for (heads, dim, dtype), rule in table.items():
            if not isinstance(rule, DenseRule):
                continue
            key = ledger_key(heads, dim, dtype, device, replayed=rule.replayed)
            # A length this thread holds already (an earlier capture of the same geometry) is not built again.
            if not (lengths := [n for n in warm_lengths(rule, rows) if not LEDGER.bought(key, n)]):
                continue
            qkv = [torch.randn(lengths[-1], heads, dim, device=device, dtype=dtype, generator=gen) for _ in "qkv"]
            for length in lengths:
                padded_dense(*(t[:length - 1] for t in qkv), dim**-0.5, length)
                LEDGER.own(key, length)
                built += 1
            del qkv
        torch.cuda.synchronize(device)
    seconds = round(time.perf_counter() - start, 3)
    if built:
        log.info("encgraph: built %d dense attention plans at bucket lengths %d..%d rows in %.1f s.", built,
                 rows[0], rows[1], seconds)
    return {"lengths": built, "seconds": seconds}


def plan_build(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> PlanBuild:
    """The :data:`~encgraph.packing.kernels.PlanBuild` of the dense calls a host-planned attention makes over
    slices of ``query``, ``key`` and ``value`` (``(tokens, heads, head_dim)``; key and value with fewer heads are
    repeated to the query's first, into contiguous tensors): ``build(rows)`` runs
    :func:`~encgraph.models.dense_sequence.dense_sequence` once at ``rows`` rows on uninitialised scratch
    tensors of the same sizes, strides, dtype and device, so that torch builds the cuDNN plan the real calls will
    find (torch keys it by those, not by the values or the addresses; per thread: build it in the thread that runs
    the calls). Keeps only that metadata, never the tensors. Each build allocates its three inputs and the output
    (``rows x heads x head_dim``, times the row stride's excess over ``heads x head_dim`` for views of a fused
    projection) for the one call, and runs one dense kernel on the current stream (about 0.3 ms at 5,000 rows
    on an H200) whose output is dropped."""
    heads = int(query.shape[1])
    layouts = []
    for t in (query, key, value):
        shape = (heads, int(t.shape[2]))
        # _host_planned_attention repeats grouped heads with repeat_interleave: a fresh contiguous tensor
        strides = tuple(t.stride()) if int(t.shape[1]) == heads else (heads * shape[1], shape[1], 1)
        layouts.append((shape, strides))
    dtype, device = query.dtype, query.device

    def build(rows: int) -> None:
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with torch.no_grad(), on_device:
            q, k, v = (torch.empty_strided((rows, *shape), strides, dtype=dtype, device=device)
                       for shape, strides in layouts)
            dense_sequence(q, k, v, scale)

    return build
