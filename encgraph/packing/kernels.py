"""The measured attention-kernel crossover of one head geometry on one device: part of the cost model's JSON.

An eager forward knows every attention sequence on the host, so it can run each long one as a dense SDPA call
(cuDNN on an H200: 346-428 TF/s at head dim 72-80) instead of one Flash varlen call over all of them (207-258
TF/s), while many short sequences stay faster in one varlen call (one launch instead of one each). Where the
two cross depends on the device, the head geometry and the dtype, so it is measured at capture
(:func:`encgraph.models.kernel_choice.measure_crossover`): one sequence of each of a few lengths through both
kernels. :class:`Crossover` keeps those timings and derives the crossover from them; the cost model
(:class:`~encgraph.packing.CostModel`, field ``kernels``) stores it so that a saved model carries it too.
Pure Python: importing it never imports torch.

>>> c = Crossover("NVIDIA H200", 16, 72, "bfloat16", (1024, 4096, 16384), (0.05, 0.4, 5.5), (0.06, 0.3, 3.5))
>>> c.min_rows, c.key
(4096, 'NVIDIA H200/16x72/bfloat16')
"""

from __future__ import annotations

import bisect
import contextlib
import math
import statistics
import threading
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from encgraph._validate import check_int, check_mapping, check_sequence, check_str, describe
from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing.eager_cost import checked_ms

__all__ = ["LEDGER", "Crossover", "DenseRule", "PlanLedger", "crossover_rows", "kernel_key", "kernel_table"]


def kernel_key(device: str, heads: int, head_dim: int, dtype: str) -> str:
    """``"<device name>/<heads>x<head_dim>/<dtype>"``: what a crossover is measured for."""
    return f"{device}/{heads}x{head_dim}/{dtype}"


def crossover_rows(lengths: Sequence[int], varlen_ms: Sequence[float], dense_ms: Sequence[float]) -> int | None:
    """The smallest measured length from which the dense per-sequence kernel is at least as fast as varlen at
    that length and at every longer one measured; ``None`` where varlen wins at the longest (dense never pays).
    Lengths are sorted ascending."""
    best: int | None = None
    for length, v, d in reversed(list(zip(lengths, varlen_ms, dense_ms))):
        if d > v:
            break
        best = length
    return best


def _ints(name: str, value: Any) -> tuple[int, ...]:
    check_sequence(name, value, hint="Pass the measured sequence lengths, ascending.")
    out = tuple(check_int(f"{name}[{i}]", v, minimum=1) for i, v in enumerate(value))
    if not out or any(b <= a for a, b in zip(out, out[1:])):
        raise ConfigError(f"{name}: expected at least one length, strictly ascending, got {list(out)}.")
    return out


def _times(name: str, value: Any) -> tuple[float, ...]:
    check_sequence(name, value, hint="Pass one measured time (ms) per length.")
    return tuple(checked_ms(f"{name}[{i}]", v) for i, v in enumerate(value))


@attrs.frozen
class Crossover:
    """One measurement: per sequence length, the ms of one sequence through Flash varlen and through dense SDPA.

    Attributes:
        device: the device's name (``torch.cuda.get_device_name``); a model loaded on another device is measured
            again.
        heads, head_dim, dtype: the head geometry and dtype measured (``"bfloat16"``).
        lengths: rows of the one sequence, ascending.
        varlen_ms, dense_ms: one time per length.
        dense_first_ms: the dense kernel's first call at each length (a new shape: cuDNN builds a plan for it;
            the tower's own SDPA pays the same), or empty; :attr:`plan_ms` is derived from it.
        min_rows: derived (:func:`crossover_rows`) from the medians: sequences of at least this many rows run
            dense; ``None``: never.
    """

    device: str = attrs.field(converter=lambda v: check_str("Crossover(device)", v))
    heads: int = attrs.field(converter=lambda v: check_int("Crossover(heads)", v, minimum=1))
    head_dim: int = attrs.field(converter=lambda v: check_int("Crossover(head_dim)", v, minimum=1))
    dtype: str = attrs.field(converter=lambda v: check_str("Crossover(dtype)", v))
    lengths: tuple[int, ...] = attrs.field(converter=lambda v: _ints("Crossover(lengths)", v))
    varlen_ms: tuple[float, ...] = attrs.field(converter=lambda v: _times("Crossover(varlen_ms)", v))
    dense_ms: tuple[float, ...] = attrs.field(converter=lambda v: _times("Crossover(dense_ms)", v))
    dense_first_ms: tuple[float, ...] = attrs.field(
        default=(), kw_only=True, converter=lambda v: _times("Crossover(dense_first_ms)", v) if v else ())
    min_rows: int | None = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if not len(self.varlen_ms) == len(self.dense_ms) == len(self.lengths):
            raise ConfigError(
                f"Crossover: expected one varlen and one dense time per length ({len(self.lengths)}), got "
                f"{len(self.varlen_ms)} and {len(self.dense_ms)}."
            )
        if self.dense_first_ms and len(self.dense_first_ms) != len(self.lengths):
            raise ConfigError(
                f"Crossover(dense_first_ms): expected one time per length ({len(self.lengths)}) or none, got "
                f"{len(self.dense_first_ms)}."
            )
        object.__setattr__(self, "min_rows", crossover_rows(self.lengths, self.varlen_ms, self.dense_ms))

    @property
    def key(self) -> str:
        return kernel_key(self.device, self.heads, self.head_dim, self.dtype)

    @property
    def plan_ms(self) -> float:
        """What the dense kernel's first call at a new length costs beyond its later calls (the median over the
        measured lengths of ``dense_first_ms - dense_ms``, at least 0): cuDNN building the plan of that shape,
        about 35 ms on an H200 whatever the length. 0.0 when no first calls were recorded."""
        if not self.dense_first_ms:
            return 0.0
        return max(statistics.median(f - d for f, d in zip(self.dense_first_ms, self.dense_ms)), 0.0)

    def ms_at(self, rows: int) -> tuple[float, float]:
        """``(varlen ms, dense ms)`` of one call on one sequence of ``rows`` rows: linear in log-log between the
        measured lengths, extended past the longest (and below the shortest) with the slope of the nearest
        pair (attention is quadratic, so about 2)."""
        lengths = self.lengths
        if len(lengths) == 1:
            scale = (rows / lengths[0]) ** 2
            return self.varlen_ms[0] * scale, self.dense_ms[0] * scale
        i = min(max(bisect.bisect_right(lengths, rows) - 1, 0), len(lengths) - 2)
        x0, x1 = math.log(lengths[i]), math.log(lengths[i + 1])
        t = (math.log(max(rows, 1)) - x0) / (x1 - x0)

        def at(times: Sequence[float]) -> float:
            y0, y1 = (math.log(max(v, 1e-9)) for v in (times[i], times[i + 1]))
            return math.exp(y0 + t * (y1 - y0))

        return at(self.varlen_ms), at(self.dense_ms)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``min_rows`` is written for readers and recomputed on load."""
        return {"device": self.device, "heads": self.heads, "head_dim": self.head_dim, "dtype": self.dtype,
                "lengths": list(self.lengths), "varlen_ms": list(self.varlen_ms), "dense_ms": list(self.dense_ms),
                "dense_first_ms": list(self.dense_first_ms), "min_rows": self.min_rows}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Crossover:
        check_mapping("Crossover.from_dict(data)", data, hint="Pass the dict Crossover.to_dict() returned.")
        fields = {k: v for k, v in data.items() if k != "min_rows"}
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ConfigError(
                f"Crossover.from_dict(data): {exc}. Pass the dict Crossover.to_dict() returned."
            ) from None


def kernel_table(value: Any) -> dict[str, Crossover]:
    """``CostModel(kernels=...)``'s converter: ``{key: Crossover or its dict}`` (or ``None``) to ``{key:
    Crossover}``; each key must be its crossover's :attr:`Crossover.key`."""
    if value is None:
        return {}
    check_mapping("CostModel(kernels)", value, hint="Pass {key: Crossover} (or None for none).")
    out: dict[str, Crossover] = {}
    for key, entry in value.items():
        c = Crossover.from_dict(entry) if isinstance(entry, Mapping) else entry
        if not isinstance(c, Crossover):
            raise ConfigTypeError(f"CostModel(kernels[{key!r}]): expected a Crossover, got {describe(entry)}.")
        if key != c.key:
            raise ConfigError(f"CostModel(kernels): key {key!r} names another geometry than its entry's {c.key!r}.")
        out[key] = c
    return out


@attrs.frozen
class DenseRule:
    """Which sequences of an eager forward run dense, for one head geometry: none shorter than ``min_rows``
    (``None``: none at all); from there, a length whose dense plan this thread has built runs dense, and a new
    length runs dense once the time varlen has cost it (rent) plus what dense would save over the ``calls``
    attention calls of one forward reaches :attr:`Crossover.plan_ms` (buy); until then it runs varlen and the
    saving it missed is added to its rent (:class:`PlanLedger`). Without a measured ``crossover`` (or with no
    plan cost measured) every sequence from ``min_rows`` runs dense.

    Attributes:
        min_rows: the crossover's rows, or ``None``.
        crossover: the measurement the times come from, or ``None``.
        calls: attention calls per forward that run with host bounds at this geometry (the tower's
            full-attention layers), at least 1.
    """

    min_rows: int | None
    crossover: Crossover | None = None
    calls: int = attrs.field(default=1, converter=lambda v: check_int("DenseRule(calls)", v, minimum=1))

    @property
    def plan_ms(self) -> float:
        return self.crossover.plan_ms if self.crossover is not None else 0.0

    def rent_ms(self, rows: int, paid_ms: float) -> float | None:
        """The call at hand at a length not bought, whose rent so far is ``paid_ms``: the saving it misses by
        renting (varlen), or ``None`` where it buys (the rent plus one forward's saving reaches the plan)."""
        gain = self.gain_ms(rows)
        return gain if paid_ms + self.calls * gain < self.plan_ms else None

    def gain_ms(self, rows: int) -> float:
        """ms one call at ``rows`` rows saves on dense against varlen, at least 0."""
        if self.crossover is None:
            return 0.0
        varlen, dense = self.crossover.ms_at(rows)
        return max(varlen - dense, 0.0)


class PlanLedger:
    """Rent-or-buy of the dense kernel's plans, per thread: torch keeps cuDNN's attention plans in a cache per
    thread (``getMHAGraphCache_`` in ``aten/src/ATen/native/cudnn/MHA.cpp``: ``thread_local``, never evicted), so a
    length this thread has run dense is free to run dense again, and a new one costs a plan. The state (the
    lengths bought, the rent of the others) grows with the distinct lengths a thread sees: one entry each.

    >>> rule = DenseRule(1024, Crossover("gpu", 16, 72, "bfloat16", (1024, 4096), (1.0, 10.0), (0.5, 5.0),
    ...                                  dense_first_ms=(30.5, 35.0)), calls=4)
    >>> ledger = PlanLedger()
    >>> [ledger.dense("g", 4096, rule) for _ in range(4)]  # saves 5 ms a call: rent 10 + a forward's 20 = the plan
    [False, False, True, True]
    >>> ledger.dense("g", 1000, rule), ledger.dense("g", 8192, rule)  # under min_rows; saves 80 a forward
    (False, True)
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._counts = {"bought": 0, "rented_calls": 0}  # every thread's, for stats (int updates under the GIL)

    def _state(self) -> tuple[set[Hashable], dict[Hashable, float]]:
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = (set(), {})
        return state

    def dense(self, key: Hashable, rows: int, rule: DenseRule) -> bool:
        """Whether the call at hand runs its sequence of ``rows`` rows (head geometry ``key``) dense; a rented
        call adds its missed saving to the length's rent, a bought length is remembered."""
        if rule.min_rows is None or rows < rule.min_rows:
            return False
        plan = rule.plan_ms
        if plan <= 0.0:
            return True
        bought, rent = self._state()
        entry = (key, rows)
        if entry in bought:
            return True
        if not getattr(self._local, "buying", False):  # inside buying(): bought at once
            missed = rule.rent_ms(rows, rent.get(entry, 0.0))
            if missed is not None:
                rent[entry] = rent.get(entry, 0.0) + missed
                self._counts["rented_calls"] += 1
                return False
        bought.add(entry)
        rent.pop(entry, None)
        self._counts["bought"] += 1
        return True

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

    def _rented(self, key: Hashable, rows: Sequence[int], rule: DenseRule) -> Iterator[tuple[Hashable, float]]:
        """``(length's entry, missed saving)`` of each call that one forward of ``rule.calls`` attention calls over
        sequences of ``rows`` rows would rent, in order, from this thread's ledger as it stands; a length stops
        renting at the call where :meth:`dense` would buy it. Changes nothing."""
        if rule.min_rows is None or rule.plan_ms <= 0.0 or getattr(self._local, "buying", False):
            return
        bought, rent = self._state()
        # The sequences that could rent (long, at a length not bought); none in the usual steady case.
        pending = [(key, int(n)) for n in rows if n >= rule.min_rows and (key, int(n)) not in bought]
        paid: dict[Hashable, float] = {}  # this forward's view of the rent of the lengths it meets
        for _ in range(rule.calls if pending else 0):
            for entry in pending:
                if paid.get(entry) == math.inf:
                    continue
                so_far = paid.get(entry, rent.get(entry, 0.0))
                missed = rule.rent_ms(entry[1], so_far)
                if missed is None:
                    paid[entry] = math.inf  # bought at this call: dense from here on
                else:
                    paid[entry] = so_far + missed
                    yield entry, missed

    def surcharge_ms(self, key: Hashable, rows: Sequence[int], rule: DenseRule) -> float:
        """What one eager forward whose attention sequences have ``rows`` rows (head geometry ``key``,
        ``rule.calls`` calls each, in order) would lose to rent against its steady kernels, the cost model's price
        (:meth:`buying`): per call that :meth:`dense` would rent, the saving it misses (:meth:`DenseRule.gain_ms`).
        A plan bought on the way is not counted: buying is the rule's decision (rent until the rent paid reaches
        the plan, then buy: never more than twice the best choice in hindsight), not a cost to avoid; pricing it
        would make a replay look cheaper every time and the length would rent for ever. Reads this thread's
        ledger without changing it.

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
        _, rent = self._state()
        calls = list(self._rented(key, rows, rule))
        for entry, gain in calls:
            rent[entry] = rent.get(entry, 0.0) + gain
        self._counts["rented_calls"] += len(calls)
        return len(calls)

    def bought(self, key: Hashable, rows: int) -> bool:
        return (key, rows) in self._state()[0]

    @property
    def rented_calls(self) -> int:
        """Calls rented so far, every thread's (monotonic): a run that moved it rented a kernel."""
        return self._counts["rented_calls"]

    def stats(self) -> dict[str, int]:
        """``{"bought": lengths bought, "rented_calls": calls that ran a long sequence on varlen while its
        length was rented}``, over every thread since the process started (monotonic)."""
        return dict(self._counts)

    def clear(self) -> None:
        """Forget this thread's lengths (tests; torch's own cache cannot be emptied)."""
        self._local.state = None


LEDGER = PlanLedger()
"""The process's ledger (:mod:`encgraph.models.sequence_bounds` consults it): every tower of a head geometry
shares torch's per-thread plan cache, so they share its lengths."""
