"""Which long sequences of an eager forward (or of a piecewise replay's split calls) run on the dense attention
kernel, and at which length, for one head geometry: :class:`DenseRule`, from its measured
:class:`~encgraph.packing.crossover.Crossover`. The per-thread rent-or-buy of the plans it needs is
:class:`~encgraph.packing.kernels.PlanLedger`'s. Pure Python: importing it never imports torch.
"""

from __future__ import annotations

import attrs

from encgraph._validate import check_int
from encgraph.packing.crossover import Crossover

__all__ = ["DenseRule"]


@attrs.frozen
class DenseRule:
    """Which sequences of an eager forward run dense, for one head geometry: none shorter than ``min_rows``
    (``None``: none at all); from there, a sequence runs dense at its run length (:meth:`run_rows`: its bucket
    from the crossover's :attr:`~encgraph.packing.crossover.Crossover.bucket_from` rows, so one plan serves many
    lengths); a run length whose dense plan this thread has built does so at once, and a new one once the time
    varlen has cost it (rent) plus what dense would save over the ``calls`` attention calls of one forward reaches
    the crossover's ``plan_ms`` (buy); until then it runs varlen, or padded to its bucket where that is faster and
    the bucket's plan is held (:meth:`stand_in_rows`: capture builds them), and the saving it missed is added to
    its rent. A sequence at a bucket held rents its own length the same way, by what the padding costs
    (:meth:`refine_ms`). The rent and the plans held are the ledger's
    (:class:`~encgraph.packing.kernels.PlanLedger`). Without a measured ``crossover`` (or with no plan cost
    measured) every sequence from ``min_rows`` runs dense.

    Attributes:
        min_rows: the crossover's rows, or ``None``.
        crossover: the measurement the times come from, or ``None``.
        calls: attention calls per forward that run with host bounds at this geometry (the tower's
            full-attention layers), at least 1.
        replayed: the rule of calls between a piecewise replay's segments (:mod:`encgraph.capture.piecewise`):
            their bucket lengths and stand-ins start at the crossover's :attr:`~Crossover.replay_bucket_from` and
            :attr:`~Crossover.replay_stand_in_from` and are priced at the padded call's device time (the host
            issues its copies while the segment before runs), where an eager forward's start at
            :attr:`~Crossover.bucket_from` and :attr:`~Crossover.stand_in_from`, priced as issued back to back.
            Its lengths are kept apart in the ledger (:func:`encgraph.models.sequence_bounds.ledger_key`).
    """

    min_rows: int | None
    crossover: Crossover | None = None
    calls: int = attrs.field(default=1, converter=lambda v: check_int("DenseRule(calls)", v, minimum=1))
    replayed: bool = attrs.field(default=False, kw_only=True)
    # refine_ms by rows: read at every call of a long sequence at a bucket held, which a new size makes for good
    _refined: dict[int, float | None] = attrs.field(factory=dict, init=False, eq=False, repr=False)

    @property
    def plan_ms(self) -> float:
        return self.crossover.plan_ms if self.crossover is not None else 0.0

    def rent_ms(self, rows: int, paid_ms: float, *, stand_in: bool = False) -> float | None:
        """The call at hand at a length not bought, whose rent so far is ``paid_ms``: the saving it misses by
        renting (on varlen, or padded to its bucket where ``stand_in``: :meth:`stand_in_rows`, a plan held), or
        ``None`` where it buys (the rent plus one forward's saving reaches the plan)."""
        gain = self.gain_ms(rows, stand_in=stand_in)
        return gain if paid_ms + self.calls * gain < self.plan_ms else None

    def gain_ms(self, rows: int, *, stand_in: bool = False) -> float:
        """ms one call at ``rows`` rows saves on dense (as it runs:
        :meth:`~encgraph.packing.crossover.Crossover.dense_at`) against varlen, or with ``stand_in`` against the
        padded call at its bucket (:meth:`stand_in_rows`), at least 0."""
        if self.crossover is None:
            return 0.0
        dense = self.crossover.dense_at(rows, replayed=self.replayed)
        padded = self.crossover.stand_in(rows, replayed=self.replayed) if stand_in else None
        return max((self.crossover.ms_at(rows)[0] if padded is None else padded[1]) - dense, 0.0)

    def stand_in_rows(self, rows: int) -> int | None:
        """The bucket length a sequence of ``rows`` rows may run at while its own run length rents (where this
        thread holds that bucket's plan: :class:`~encgraph.packing.kernels.PlanLedger`), padded, faster than varlen
        (:meth:`~encgraph.packing.crossover.Crossover.stand_in`, for eager or replayed calls); ``None``: it rents
        varlen."""
        padded = self.crossover.stand_in(rows, replayed=self.replayed) if self.crossover is not None else None
        return None if padded is None else padded[0]

    def refine_ms(self, rows: int) -> float | None:
        """ms one call over a sequence of ``rows`` rows that runs at its bucket (from :attr:`bucket_from`, not a
        bucket length itself) would save at its own length: the padded call's time against the exact kernel's,
        at least 0; what its exact length rents by while this thread holds the bucket's plan
        (:meth:`~encgraph.packing.kernels.PlanLedger.run_length`). ``None`` where it runs at its own length already."""
        if rows not in self._refined:
            run = self.run_rows(rows)
            c = self.crossover
            self._refined[rows] = (None if c is None or run == rows
                                   else max(c.padded_at(run, replayed=self.replayed) - c.ms_at(rows)[1], 0.0))
        return self._refined[rows]

    def may_run_dense(self, rows: int) -> bool:
        """Whether a sequence of ``rows`` rows ever runs dense: from ``min_rows``, except where it would run
        padded to its bucket no faster than varlen."""
        if self.min_rows is None or rows < self.min_rows:
            return False
        return self.run_rows(rows) == rows or self.gain_ms(rows) > 0.0

    def run_rows(self, rows: int) -> int:
        """The length a dense call over ``rows`` rows runs at, whose plan it needs
        (:meth:`~encgraph.packing.crossover.Crossover.run_rows`;
        ``rows`` without a crossover)."""
        return self.crossover.run_rows(rows, replayed=self.replayed) if self.crossover is not None else int(rows)

    @property
    def bucket_from(self) -> int | None:
        """Rows from which dense calls run at bucket lengths (the crossover's, for eager or replayed calls), or
        ``None``: never."""
        return self.crossover.bucket_start(replayed=self.replayed) if self.crossover is not None else None

    @property
    def warm_from(self) -> int | None:
        """Rows from which a dense call may run at a bucket length (:attr:`bucket_from`, or earlier where it
        stands in: :meth:`~encgraph.packing.crossover.Crossover.stand_in_start`), whose plans capture builds; or
        ``None``."""
        if self.crossover is None:
            return None
        starts = (self.bucket_from, self.crossover.stand_in_start(replayed=self.replayed))
        return min((s for s in starts if s is not None), default=None)
