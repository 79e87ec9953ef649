"""The packed attention's side of a piecewise capture (:mod:`encgraph.capture.piecewise`): which calls split, and
how a split call attends between two segments' replays.

A call splits where its head geometry has a measured crossover (the adapter's ``kernel_rows``, handed to the
splitter) and its ``max_seqlen`` reaches the rows from which a sequence may run dense: only there can a replay
gain from attending outside the graph. Between segments the call attends its real sequences by the host bounds the
fill wrote, each long one on the dense kernel where this thread's plan ledger says so (rent-or-buy, as an eager
forward does), the others in runs on the varlen kernel; the padding rows' attention output is zero (their rows
are never returned, and attend nothing: no NaN or stale value can reach a real row).

A long sequence runs dense at its own length once this thread holds that plan (bought by rent-or-buy), and
until then at its bucket length (:func:`~encgraph.packing.kernels.bucket_rows`) from the crossover's
:attr:`~encgraph.packing.kernels.Crossover.replay_stand_in_from`, where the padded call's device time beats varlen
(between segments the host issues its copies while the segment before runs); from
:attr:`~encgraph.packing.kernels.Crossover.replay_bucket_from`, where padding costs little against the exact
kernel, at its bucket always. Capture builds the buckets' plans up to the largest split budget's rows
(:meth:`SplitCall.warm`), so that an image size met for the first time runs dense at once, and one met again
runs at its own length once it paid its plan: on an H200 the padded call costs 1.3x the exact kernel at 4,096-8,192
rows, and a 4,960-row image's split replay at budget 1280 took 26.5 ms at its bucket against 22 at its length.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from encgraph.capture import piecewise
from encgraph.models import dense_plans, sequence_bounds
from encgraph.models.sequence_bounds import RowsTable
from encgraph.packing.kernels import DenseRule

__all__ = ["SplitCall", "offer"]


Attend = Callable[..., torch.Tensor]
"""``encgraph.models.attention._host_planned_attention``: (query, key, value, cu_seqlens, scale, bounds, dense
rows per sequence, out=) -> out (passed in: that module imports this one)."""


def offer(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
          scale: float | None, attend: Attend) -> torch.Tensor | None:
    """Inside a piecewise capture (or its discovery), offer this call to the splitter when it may split; its
    output where it split, else ``None`` (the call runs in the graph as usual). A geometry missing from the table
    (no crossover measured) never splits: its gain is unknown."""
    split = piecewise.splitter()
    if split is None or not torch.cuda.is_current_stream_capturing():
        return None
    call = SplitCall(split.table, (int(query.shape[1]), int(query.shape[2]), query.dtype), scale, attend)
    rule = call.rule
    if rule.crossover is None or rule.min_rows is None or int(max_seqlen) < rule.min_rows:
        return None
    return split.offer(query, key, value, cu_seqlens, call)


@attrs.frozen
class SplitCall:
    """One split attention call (:class:`~encgraph.capture.piecewise.PieceAttention`): the adapter's rows table and
    the call's head geometry (its dense rule is read from the table at each use, so that a table the adapter
    updates in place holds for later replays), its softmax scale and the host-planned attention it runs
    (:data:`Attend`)."""

    table: RowsTable
    geometry: tuple[int, int, torch.dtype]
    scale: float | None
    attend: Attend

    @property
    def rule(self) -> DenseRule:
        """The table's rule for this geometry as calls between segments run it (:attr:`DenseRule.replayed`)."""
        rule = self.table.get(self.geometry) if self.table is not None else None
        if rule is None:
            return DenseRule(None)
        return _replayed(rule if isinstance(rule, DenseRule) else DenseRule(rule))

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
            bounds: Sequence[int], out: torch.Tensor, dense: bool) -> None:
        """Attention of the real sequences ``bounds`` into ``out``; zeros in the padding rows after them."""
        n = int(bounds[-1])
        if n < out.shape[0]:
            out[n:].zero_()
        if n == 0:
            return
        if dense:
            flags = sequence_bounds.dense_flags(
                query, bounds, self.rule, lambda: dense_plans.plan_build(query, key, value, self.scale))
        else:
            flags = (0,) * (len(bounds) - 1)
        self.attend(query[:n], key[:n], value[:n], cu_seqlens, self.scale, bounds, flags, out=out[:n])

    def gain_ms(self, bounds: Sequence[int]) -> float:
        """ms the sequences of ``bounds`` that may run dense save there over the varlen kernel (at their steady
        kernels: a length not bought yet rents varlen until its rent pays the plan)."""
        rule = self.rule
        return sum(rule.gain_ms(b - a) for a, b in itertools.pairwise(bounds) if rule.may_run_dense(b - a))

    def warm(self, rows: int, device: torch.device) -> dict[str, Any]:
        """Build, in this thread, the dense plans of every bucket length up to ``rows`` that this call may run at
        (:func:`encgraph.models.dense_plans.warm_plans`, from the rule's crossover: :attr:`DenseRule.warm_from`),
        so that a replay meeting a new image size runs it dense at once (standing in at its bucket) instead of
        renting varlen. Capture time only."""
        rule = self.rule
        if rule.min_rows is None or rule.warm_from is None:
            return {"lengths": 0, "seconds": 0.0}
        return dense_plans.warm_plans({self.geometry: rule}, device, rows=(rule.min_rows, rows))


@functools.lru_cache(maxsize=64)
def _replayed(rule: DenseRule) -> DenseRule:
    """``rule`` for calls between piecewise segments (memoised: read at every split call of every replay)."""
    return attrs.evolve(rule, replayed=True)
