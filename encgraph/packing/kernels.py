"""Rent-or-buy of the dense attention kernel's plans: which run lengths this thread holds a plan for
(:class:`PlanLedger`, :data:`LEDGER`), for the rules of which long sequences run dense
(:class:`~encgraph.packing.dense_rule.DenseRule`, one per head geometry, from its measured
:class:`~encgraph.packing.crossover.Crossover`). The rule's and the crossover's names are re-exported here. Pure
Python: importing it never imports torch.

A length bought inside :meth:`PlanLedger.deferring` (the runner's calls, the serving front's) falls due instead
of being built by the call at hand: cuDNN builds a plan on the host (about 40 ms on an H200) while the device,
with only the layers issued so far queued, waits. The call goes on renting, and the plan is built once the call
has issued all its work (the device then runs it meanwhile) or when the serving front is idle.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence

import attrs

from encgraph.packing.crossover import (
    BUCKET_SLACK,
    PER_OCTAVE,
    Crossover,
    bucket_rows,
    crossover_rows,
    kernel_key,
    kernel_table,
)
from encgraph.packing.dense_rule import DenseRule

__all__ = ["BUCKET_SLACK", "LEDGER", "PER_OCTAVE", "Crossover", "DenseRule", "PlanBuild", "PlanLedger", "bucket_rows",
           "crossover_rows", "kernel_key", "kernel_table"]

log = logging.getLogger("encgraph")

PlanBuild = Callable[[int], None]
"""Builds, in the calling thread, the dense plan of one run length (its argument, in rows): one dense call at
that length on scratch inputs laid out as the call that fell due laid its own
(:func:`encgraph.models.dense_plans.plan_build`). It holds no tensor of that call."""


@attrs.define
class _Due:
    """A length fallen due in :meth:`PlanLedger.deferring`: its builder, its run length, and how many outermost
    deferring blocks have ended since (``age``)."""

    build: PlanBuild
    rows: int
    age: int = 0


class PlanLedger:
    """Rent-or-buy of the dense kernel's plans, per thread: torch keeps cuDNN's attention plans in a cache per
    thread (``getMHAGraphCache_`` in ``aten/src/ATen/native/cudnn/MHA.cpp``: ``thread_local``, never evicted), so a
    length this thread has run dense is free to run dense again, and a new one costs a plan. The state (the
    lengths bought, the rent of the others, those due) grows with the distinct lengths a thread sees: one entry
    each.

    >>> rule = DenseRule(1024, Crossover("gpu", 16, 72, "bfloat16", (1024, 4096), (1.0, 10.0), (0.5, 5.0),
    ...                                  dense_first_ms=(30.5, 35.0)), calls=4)
    >>> ledger = PlanLedger()
    >>> [ledger.dense("g", 4096, rule) for _ in range(4)]  # saves 5 ms a call: rent 10 + a forward's 20 = the plan
    [False, False, True, True]
    >>> ledger.dense("g", 1000, rule), ledger.dense("g", 8192, rule)  # under min_rows; saves 80 a forward
    (False, True)
    >>> built = []
    >>> with ledger.deferring():  # the same purchase, deferred: built once the block has issued its work
    ...     [ledger.dense("h", 4096, rule, builder=lambda: built.append) for _ in range(4)], built
    ([False, False, False, False], [])
    >>> built, ledger.dense("h", 4096, rule)
    ([4096], True)
    """

    def __init__(self) -> None:
        self._local = threading.local()
        # every thread's, for stats (int updates under the GIL)
        self._counts = {"bought": 0, "rented_calls": 0, "stand_in_calls": 0, "warmed": 0, "deferred": 0,
                        "refining_calls": 0}

    def _state(self) -> tuple[set[Hashable], dict[Hashable, float], dict[Hashable, _Due]]:
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = (set(), {}, {})
        return state

    def _deferring(self) -> bool:
        return getattr(self._local, "defer_depth", 0) > 0

    def run_length(self, key: Hashable, rows: int, rule: DenseRule,
                   builder: Callable[[], PlanBuild] | None = None) -> int:
        """The rows the call at hand runs its sequence of ``rows`` rows (head geometry ``key``) dense at (its run
        length, or while that rents the bucket it stands in at: :meth:`DenseRule.stand_in_rows`), or 0: varlen.
        A rented call adds its missed saving to the length's rent, a bought length is remembered. A sequence
        whose bucket is held runs at its own length once that is bought in turn (:meth:`_refined`).

        Inside :meth:`deferring`, a length whose rent reaches its plan falls due instead, when ``builder`` is
        given (called then, once: it returns the :data:`PlanBuild` of the call at hand's layout): this call and
        the block's later ones keep renting, and the plan is built when the block ends (:meth:`build_due`). Not
        a length bought at first sight (one forward's saving pays its plan): this forward's later calls gain
        more from the plan than the deferral would save, so the call at hand builds it."""
        if not rule.may_run_dense(rows):
            return 0
        run = rule.run_rows(rows)
        if rule.plan_ms <= 0.0:
            return run
        entry = (key, run)
        if entry in self._state()[0]:
            return run if run == rows else self._refined(key, rows, run, rule, builder)
        if not getattr(self._local, "buying", False):  # inside buying(): bought at once
            stand_in = self._stand_in(key, rows, rule)
            if self._rents(entry, run, rule.gain_ms(rows, stand_in=stand_in is not None), rule, builder):
                self._counts["rented_calls"] += 1
                if stand_in is None:
                    return 0
                self._counts["stand_in_calls"] += 1
                return stand_in
        self._hold(entry, "bought")
        return run

    def _rents(self, entry: Hashable, run: int, gain: float, rule: DenseRule,
               builder: Callable[[], PlanBuild] | None) -> bool:
        """Whether the call at hand rents ``entry`` (a length of ``run`` rows, whose plan would save ``gain`` ms
        a call) rather than buying it; a rented call adds ``gain`` to its rent. It rents while its rent plus one
        forward's saving stays under the plan; inside :meth:`deferring`, a due length rents, and one whose rent
        reaches the plan falls due (with a ``builder``: it is called then), except where one forward's saving
        alone pays the plan (bought at first sight: this forward's later calls gain more from the plan than the
        deferral would save)."""
        _, rent, due = self._state()
        paid, deferring = rent.get(entry, 0.0), self._deferring()
        if not (deferring and entry in due) and paid + rule.calls * gain >= rule.plan_ms:
            if builder is None or not deferring or rule.calls * gain >= rule.plan_ms:
                return False
            due[entry] = _Due(builder(), run)
            self._counts["deferred"] += 1
        rent[entry] = paid + gain
        return True

    def _refined(self, key: Hashable, rows: int, run: int, rule: DenseRule,
                 builder: Callable[[], PlanBuild] | None) -> int:
        """The length a sequence of ``rows`` rows runs at whose bucket ``run`` this thread holds: its own once
        bought; until then the bucket, while the exact length rents by what the padded call misses
        (:meth:`DenseRule.refine_ms`) and is bought (inside :meth:`deferring`, falls due) once that pays its plan,
        as a length below the buckets is (:meth:`_rents`). A photo size that recurs so ends on the exact kernel,
        as the tower's own SDPA holds it, and a new one still pays no plan. Counted as ``refining_calls``; not in
        :meth:`surcharge_ms` (the cost model prices these calls at the bucket) nor in ``rented_calls``."""
        exact = (key, rows)
        if exact in self._state()[0]:
            return rows
        gain = rule.refine_ms(rows)
        if not gain or getattr(self._local, "buying", False):
            return run
        if self._rents(exact, rows, gain, rule, builder):
            self._counts["refining_calls"] += 1
            return run
        self._hold(exact, "bought")
        return rows

    def dense(self, key: Hashable, rows: int, rule: DenseRule,
              builder: Callable[[], PlanBuild] | None = None) -> bool:
        """Whether the call at hand runs its sequence of ``rows`` rows dense (:meth:`run_length`, at its run
        length or standing in at its bucket)."""
        return self.run_length(key, rows, rule, builder) > 0

    def _stand_in(self, key: Hashable, rows: int, rule: DenseRule) -> int | None:
        """The bucket a rented sequence of ``rows`` rows runs at (:meth:`DenseRule.stand_in_rows`) where this
        thread holds its plan, else ``None``."""
        bucket = rule.stand_in_rows(rows)
        return bucket if bucket is not None and (key, bucket) in self._state()[0] else None

    def _hold(self, entry: Hashable, counter: str) -> None:
        """This thread holds ``entry``'s plan from now on (its rent and its due build forgotten), counted under
        ``counter``."""
        bought, rent, due = self._state()
        bought.add(entry)
        rent.pop(entry, None)
        due.pop(entry, None)
        self._counts[counter] += 1

    @contextlib.contextmanager
    def buying(self) -> Iterator[None]:
        """Inside the block this thread buys every length that reaches a rule's ``min_rows`` at once: capture
        times eager forwards at their steady kernels (the untimed first call builds the plans), which is what the
        cost model prices; a length's rent at first sight is at most the varlen kernel's time, the graphs' own."""
        before = getattr(self._local, "buying", False)
        self._local.buying = True
        try:
            yield
        finally:
            self._local.buying = before

    @contextlib.contextmanager
    def deferring(self, *, build: bool = True) -> Iterator[None]:
        """Inside the block, a length this thread buys with a builder (:meth:`run_length`) falls due instead of
        being built by the call at hand. When the outermost block ends without an exception, ``build=True``
        builds what fell due (:meth:`build_due`): by then the block has issued its device work, which runs while
        the host builds, where a plan built by the call at hand leaves the device waiting. ``build=False`` (the
        serving front's worker: :class:`~encgraph.serving.BatchingFront`) leaves them for the caller to build
        when idle. Blocks nest; an inner one's ``build`` is ignored. Each outermost end ages every due length by
        one (:meth:`build_due`'s ``min_age``)."""
        depth = getattr(self._local, "defer_depth", 0)
        self._local.defer_depth = depth + 1
        ended = False
        try:
            yield
            ended = True
        finally:
            self._local.defer_depth = depth
            if depth == 0:
                for pending in self._state()[2].values():
                    pending.age += 1
                if ended and build:
                    self.build_due()

    def build_due(self, *, min_age: int = 0) -> int:
        """Build the plans of this thread's due lengths that have waited at least ``min_age`` outermost
        :meth:`deferring` blocks, oldest first, and hold them (counted as ``bought``); returns how many. Host
        time: about 40 ms each on an H200 (cuDNN's plan), plus one dense call on the device. A build that raises
        is logged and its length held anyway: its next call then builds the plan itself, as without deferral."""
        due = self._state()[2]
        ready = [(entry, pending) for entry, pending in due.items() if pending.age >= min_age]
        for entry, pending in ready:
            try:
                pending.build(pending.rows)
            except Exception as exc:  # noqa: BLE001
                # out of memory for the scratch inputs, say: the real call builds the plan, as without deferral
                log.warning("encgraph: building the dense attention plan of %d rows ahead failed (%s: %s); the "
                            "next call at that length builds it itself.", pending.rows, type(exc).__name__, exc)
            self._hold(entry, "bought")
        return len(ready)

    def due(self) -> int:
        """How many lengths of this thread are due (:meth:`deferring`), waiting for :meth:`build_due`."""
        return len(self._state()[2])

    def _rented(self, key: Hashable, rows: Sequence[int], rule: DenseRule) -> Iterator[tuple[Hashable, float]]:
        """``(length's entry, missed saving)`` of each call that one forward of ``rule.calls`` attention calls over
        sequences of ``rows`` rows would rent, in order, from this thread's ledger as it stands; a length stops
        renting at the call where :meth:`dense` would buy it (inside :meth:`deferring`, where it falls due: from
        there its calls rent as its purchase, which is not priced); one due before this forward rents at every
        call (inside a block: its plan is built when the block or the serving front chooses). Changes nothing."""
        if rule.min_rows is None or rule.plan_ms <= 0.0 or getattr(self._local, "buying", False):
            return
        bought, rent, due = self._state()
        # The sequences that could rent (long, at a length not bought); none in the usual steady case. Two of
        # one bucket share its entry (and its rent).
        pending = [(entry, int(n)) for n in rows if rule.may_run_dense(n)
                   if (entry := (key, rule.run_rows(n))) not in bought]
        paid: dict[Hashable, float] = {}  # this forward's view of the rent of the lengths it meets
        waiting = set(due) if self._deferring() else set()  # due before this forward: they rent every call
        for _ in range(rule.calls if pending else 0):
            for entry, n in pending:
                if paid.get(entry) == math.inf:
                    continue
                so_far = paid.get(entry, rent.get(entry, 0.0))
                stand_in = self._stand_in(key, n, rule) is not None
                missed = (rule.gain_ms(n, stand_in=stand_in) if entry in waiting
                          else rule.rent_ms(n, so_far, stand_in=stand_in))
                if missed is None:
                    # bought at this call (dense from here on), or fallen due: its later calls are its purchase
                    paid[entry] = math.inf
                else:
                    paid[entry] = so_far + missed
                    yield entry, missed

    def surcharge_ms(self, key: Hashable, rows: Sequence[int], rule: DenseRule) -> float:
        """What one eager forward whose attention sequences have ``rows`` rows (head geometry ``key``,
        ``rule.calls`` calls each, in order) would lose to rent against its steady kernels, the cost model's price
        (:meth:`buying`): per call that :meth:`dense` would rent, the saving it misses (:meth:`DenseRule.gain_ms`).
        A plan bought on the way is not counted: buying is the rule's decision (rent until the rent paid reaches
        the plan, then buy: never more than twice the best choice in hindsight), not a cost to avoid; pricing it
        would make a replay look cheaper every time and the length would rent for ever. Nor, for the same reason,
        the calls after a length falls due inside :meth:`deferring` (they rent to the forward's end: the rest of
        its purchase); a length due before the forward rents at every call, counted. Reads this thread's ledger
        without changing it.

        >>> rule = DenseRule(1024, Crossover("gpu", 16, 72, "bfloat16", (1024, 4096), (1.0, 10.0), (0.5, 5.0),
        ...                                  dense_first_ms=(30.5, 35.0)), calls=4)
        >>> ledger = PlanLedger()
        >>> round(ledger.surcharge_ms("g", [4096], rule), 9)  # rents two calls (5 ms each), buys at the third
        10.0
        >>> ledger.surcharge_ms("g", [1000, 8192], rule)  # under min_rows; 8192 buys at first sight
        0.0
        """
        return sum((gain for _, gain in self._rented(key, rows, rule)), 0.0)

    def rent(self, key: Hashable, rows: Sequence[int], rule: DenseRule) -> int:
        """Record that one forward over sequences of ``rows`` rows ran them on varlen in place of an eager forward
        that would have rented (the runner replayed it instead: the same kernel, without the eager launches): each
        call :meth:`surcharge_ms` counts adds its missed saving to its length's rent, as a rented call of
        :meth:`dense` does, so that the length is bought once its rent pays the plan. Returns the calls rented.

        >>> rule = DenseRule(1024, Crossover("gpu", 16, 72, "bfloat16", (1024, 4096), (1.0, 10.0), (0.5, 5.0),
        ...                                  dense_first_ms=(30.5, 35.0)), calls=4)
        >>> ledger = PlanLedger()
        >>> ledger.rent("g", [4096], rule), ledger.surcharge_ms("g", [4096], rule), ledger.dense("g", 4096, rule)
        (2, 0.0, True)
        """
        rent = self._state()[1]
        calls = list(self._rented(key, rows, rule))
        for entry, gain in calls:
            rent[entry] = rent.get(entry, 0.0) + gain
        self._counts["rented_calls"] += len(calls)
        return len(calls)

    def own(self, key: Hashable, rows: int) -> None:
        """Record that this thread built the plan of run length ``rows`` (head geometry ``key``) itself, ahead of
        any call (capture's :func:`~encgraph.models.dense_plans.warm_plans`): later calls at it run dense at
        once. Counted in :meth:`stats` as ``warmed``."""
        if (key, rows) not in self._state()[0]:
            self._hold((key, rows), "warmed")

    def bought(self, key: Hashable, rows: int) -> bool:
        """Whether this thread holds the plan of length ``rows`` (a run length: :meth:`DenseRule.run_rows`)."""
        return (key, rows) in self._state()[0]

    @property
    def rented_calls(self) -> int:
        """Calls rented so far, every thread's (monotonic): a run that moved it rented a kernel."""
        return self._counts["rented_calls"]

    def stats(self) -> dict[str, int]:
        """``{"bought": lengths bought, "rented_calls": calls that ran a long sequence on varlen or padded while
        its length was rented, "stand_in_calls": those of them padded to a bucket (:meth:`DenseRule.stand_in_rows`),
        "warmed": lengths built ahead (:meth:`own`), "deferred": purchases that fell due (:meth:`deferring`; each
        is counted under "bought" once built), "refining_calls": calls run at a bucket held while their own length
        rents (:meth:`DenseRule.refine_ms`)}``, over every thread since the process started (monotonic)."""
        return dict(self._counts)

    def clear(self) -> None:
        """Forget this thread's lengths (tests; torch's own cache cannot be emptied)."""
        self._local.state = None


LEDGER = PlanLedger()
"""The process's ledger (:mod:`encgraph.models.sequence_bounds` consults it): every tower of a head geometry
shares torch's per-thread plan cache, so they share its lengths."""
