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
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from encgraph._validate import check_int, check_mapping, check_sequence, check_str, describe
from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing.eager_cost import checked_ms

__all__ = ["BUCKET_SLACK", "FA4_MARGIN", "PER_OCTAVE", "Crossover", "bucket_rows", "crossover_rows", "faster_varlen",
           "kernel_key", "kernel_table", "loglog_at"]

PER_OCTAVE = 16
"""Bucket lengths per power of two (:func:`bucket_rows`): a sequence padded to its bucket has at most 1/16 more
rows (6.25%; attention's work at most 13% more, about 6% on average), and 16 plans cover each doubling of the
length where one plan per exact length would be needed otherwise."""

BUCKET_SLACK = 1.2
"""Sequences of a head geometry run their dense calls at bucket lengths from :attr:`Crossover.bucket_from`, the
shortest measured length from which the padded kernel, its copies and its correction included, costs at most
this much of the exact one at every longer length measured (the padded kernel runs at the sequence's own head
dim: :func:`encgraph.models.dense_sequence.padded_dense`). Where the copies into the padded buffers cost as much as
the kernel (short sequences) it fails; shorter sequences buy exact lengths, each with its own plan."""


def bucket_rows(rows: int, per_octave: int = PER_OCTAVE) -> int:
    """``rows`` rounded up to a multiple of ``2^floor(log2 rows) / per_octave`` (at least 8): the length a padded
    dense call runs at, so that one cuDNN plan serves every length of its bucket. A power of two is its own
    bucket.

    >>> [bucket_rows(r) for r in (1000, 1024, 1100, 13700, 27000)]
    [1024, 1024, 1152, 13824, 27648]
    """
    rows = int(rows)
    if rows <= 0:
        return rows
    step = max((1 << (rows.bit_length() - 1)) // per_octave, 8)
    return -(-rows // step) * step


def kernel_key(device: str, heads: int, head_dim: int, dtype: str) -> str:
    """``"<device name>/<heads>x<head_dim>/<dtype>"``: what a crossover is measured for."""
    return f"{device}/{heads}x{head_dim}/{dtype}"


def _holding_from(lengths: Sequence[int], holds: Sequence[bool]) -> int | None:
    """The smallest of ``lengths`` (ascending) from which ``holds`` is true at it and at every longer one;
    ``None`` where it fails at the longest."""
    best: int | None = None
    for length, ok in reversed(list(zip(lengths, holds))):
        if not ok:
            break
        best = length
    return best


def _bucket_from(lengths: Sequence[int], dense_ms: Sequence[float], padded_ms: Sequence[float]) -> int | None:
    """:attr:`Crossover.bucket_from` of these times (``None`` without padded ones). Where the longest length's
    ratio ``r`` is over :data:`BUCKET_SLACK`, past it: the padding's own cost (copies, correction) grows with the
    rows and the kernel's with their square, so the ratio falls as ``1 + (r - 1) L / rows``, within the slack from
    ``L (r - 1) / (slack - 1)`` rows (on an H200 measured at 1.09-1.25 at 16,384 rows, and 1.01-1.08 at 27,000;
    run to run noise must not turn buckets off for the longest images)."""
    if not padded_ms:
        return None
    ratios = [p / d for p, d in zip(padded_ms, dense_ms)]
    start = _holding_from(lengths, [r <= BUCKET_SLACK for r in ratios])
    if start is None:
        start = bucket_rows(math.ceil(round(lengths[-1] * (ratios[-1] - 1.0) / (BUCKET_SLACK - 1.0), 6)))
    return start


FA4_MARGIN = 0.95
"""FlashAttention-4 runs a geometry's varlen calls where its median time over the measured lengths is at most this
share of torch's Flash kernel's (:func:`faster_varlen`): a measured 5% at least, so that run-to-run noise does not
swap kernels between captures of one build."""


def faster_varlen(flash_ms: Sequence[float], fa4_ms: Sequence[float]) -> str:
    """``"fa4"`` where FlashAttention-4 was measured (``fa4_ms``, one per length) and the median of its ratio to
    torch's Flash kernel over the lengths is at most :data:`FA4_MARGIN`, else ``"flash"``.

    >>> faster_varlen([1.0, 2.0, 4.0], [0.7, 1.3, 2.6]), faster_varlen([1.0, 2.0], [0.99, 1.9])
    ('fa4', 'flash')
    >>> faster_varlen([1.0], [])  # not measured
    'flash'
    """
    if not fa4_ms:
        return "flash"
    return "fa4" if statistics.median(f / v for v, f in zip(flash_ms, fa4_ms)) <= FA4_MARGIN else "flash"


def crossover_rows(lengths: Sequence[int], varlen_ms: Sequence[float], dense_ms: Sequence[float]) -> int | None:
    """The smallest measured length from which the dense per-sequence kernel is at least as fast as varlen at
    that length and at every longer one measured; ``None`` where varlen wins at the longest (dense never pays).
    Lengths are sorted ascending."""
    return _holding_from(lengths, [d <= v for v, d in zip(varlen_ms, dense_ms)])


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
        fa4_ms: per length, FlashAttention-4's varlen kernel (the optional ``flash-attn-4`` wheel:
            :mod:`encgraph.models.fa4`), or empty (not installed, or not measured); :attr:`varlen_kernel` is
            derived from it.
        padded_ms: per length, the dense kernel on a sequence of fewer rows padded to that length (the padding
            keys' share taken out with the kernel's log-sum-exp:
            :func:`encgraph.models.dense_sequence.padded_dense`), its calls issued back to back as an eager forward
            issues them (the host's dozen small ops included), or empty (no bucketed calls); :attr:`bucket_from`
            is derived from it.
        padded_replay_ms: per length, the same padded call replayed from a CUDA graph: its device time alone, what
            it costs between a piecewise replay's segments, where the host issues it while the segment before runs
            (:mod:`encgraph.capture.piecewise`); or empty (not measured: those calls run at their own lengths).
            :attr:`replay_bucket_from` is derived from it.
        varlen_kernel: derived: ``"fa4"`` where FlashAttention-4 was measured faster than torch's Flash kernel
            (:func:`faster_varlen`), else ``"flash"``; the geometry's varlen calls, in graphs and eager, run it.
        min_rows: derived (:func:`crossover_rows`) from the medians of the dense kernel and of the varlen kernel
            chosen: sequences of at least this many rows run dense; ``None``: never.
        bucket_from: derived from ``padded_ms``: the shortest measured length from which the padded kernel costs
            at most :data:`BUCKET_SLACK` times the exact one at it and at every longer length measured, where dense
            calls start to run at bucket lengths (:func:`bucket_rows`; one plan per bucket); past the longest
            where that one fails (extrapolated: :func:`_bucket_from`); ``None`` without padded times.
        replay_bucket_from: derived from ``padded_replay_ms`` as :attr:`bucket_from` is from ``padded_ms``: where
            calls between piecewise segments start to run at bucket lengths; ``None`` without those times.
        stand_in_from: derived from ``padded_ms``: the shortest measured length from which an eager forward's
            padded call (as issued back to back) beats the varlen kernel at it and at every longer one
            (:func:`crossover_rows`); ``None`` without padded times, or where varlen wins at the longest. Below
            :attr:`bucket_from` a long sequence's own length is its run length, whose plan a thread buys once
            renting has paid it; from here, until then, the sequence runs padded to its bucket where the thread
            holds that bucket's plan (:meth:`stand_in`; capture builds them) instead of on varlen. On an
            H200 at 16 x 72 the padded call is 1.09 against varlen's 1.36 ms at 8,192 rows (the exact 0.77).
        replay_stand_in_from: the same from ``padded_replay_ms``, for calls between piecewise segments: on an
            H200 from 4,096 rows, where the padded call's device time (0.33 ms at 16 x 72) beats varlen's (0.35)
            but not the exact kernel's (0.25), so that a split call at a size met before runs at its own length
            and one at a new size at its bucket (a 4,960-row image's replay at budget 1280 takes 22 ms at its
            own length and 26.5 at its bucket).
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
    padded_ms: tuple[float, ...] = attrs.field(
        default=(), kw_only=True, converter=lambda v: _times("Crossover(padded_ms)", v) if v else ())
    fa4_ms: tuple[float, ...] = attrs.field(
        default=(), kw_only=True, converter=lambda v: _times("Crossover(fa4_ms)", v) if v else ())
    padded_replay_ms: tuple[float, ...] = attrs.field(
        default=(), kw_only=True, converter=lambda v: _times("Crossover(padded_replay_ms)", v) if v else ())
    varlen_kernel: str = attrs.field(init=False)
    min_rows: int | None = attrs.field(init=False)
    bucket_from: int | None = attrs.field(init=False)
    replay_bucket_from: int | None = attrs.field(init=False)
    stand_in_from: int | None = attrs.field(init=False)
    replay_stand_in_from: int | None = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if not len(self.varlen_ms) == len(self.dense_ms) == len(self.lengths):
            raise ConfigError(
                f"Crossover: expected one varlen and one dense time per length ({len(self.lengths)}), got "
                f"{len(self.varlen_ms)} and {len(self.dense_ms)}."
            )
        for name in ("dense_first_ms", "padded_ms", "fa4_ms", "padded_replay_ms"):
            times = getattr(self, name)
            if times and len(times) != len(self.lengths):
                raise ConfigError(
                    f"Crossover({name}): expected one time per length ({len(self.lengths)}) or none, got "
                    f"{len(times)}."
                )
        object.__setattr__(self, "varlen_kernel", faster_varlen(self.varlen_ms, self.fa4_ms))
        object.__setattr__(self, "min_rows", crossover_rows(self.lengths, self.chosen_varlen_ms, self.dense_ms))
        # Derived once: run_rows reads them for every long sequence of every eager attention call.
        varlen = self.chosen_varlen_ms
        for bucket, stand_in, padded in (("bucket_from", "stand_in_from", self.padded_ms),
                                         ("replay_bucket_from", "replay_stand_in_from", self.padded_replay_ms)):
            object.__setattr__(self, bucket, _bucket_from(self.lengths, self.dense_ms, padded))
            object.__setattr__(self, stand_in, crossover_rows(self.lengths, varlen, padded) if padded else None)

    @property
    def key(self) -> str:
        return kernel_key(self.device, self.heads, self.head_dim, self.dtype)

    @property
    def chosen_varlen_ms(self) -> tuple[float, ...]:
        """Per length, the ms of the varlen kernel this geometry runs (:attr:`varlen_kernel`)."""
        return self.fa4_ms if self.varlen_kernel == "fa4" else self.varlen_ms

    @property
    def plan_ms(self) -> float:
        """What the dense kernel's first call at a new length costs beyond its later calls (the median over the
        measured lengths of ``dense_first_ms - dense_ms``, at least 0): cuDNN building the plan of that shape,
        about 35 ms on an H200 whatever the length. 0.0 when no first calls were recorded."""
        if not self.dense_first_ms:
            return 0.0
        return max(statistics.median(f - d for f, d in zip(self.dense_first_ms, self.dense_ms)), 0.0)

    @property
    def bucketed(self) -> bool:
        """Whether any dense call runs at a bucket length (:attr:`bucket_from`)."""
        return self.bucket_from is not None

    def run_rows(self, rows: int, *, replayed: bool = False) -> int:
        """The rows a dense call over a sequence of ``rows`` rows runs at: its bucket from :attr:`bucket_from`
        rows (:attr:`replay_bucket_from` for a call between piecewise segments, ``replayed``), else ``rows``; the
        plan it needs is that length's."""
        start = self.bucket_start(replayed=replayed)
        return bucket_rows(rows) if start is not None and rows >= start else int(rows)

    def bucket_start(self, *, replayed: bool = False) -> int | None:
        """Rows from which dense calls run at bucket lengths: :attr:`replay_bucket_from` for calls between
        piecewise segments (``replayed``), else :attr:`bucket_from`."""
        return self.replay_bucket_from if replayed else self.bucket_from

    def stand_in_start(self, *, replayed: bool = False) -> int | None:
        """Rows from which a dense call whose own length rents may stand in at its bucket:
        :attr:`replay_stand_in_from` for calls between piecewise segments (``replayed``), else
        :attr:`stand_in_from`."""
        return self.replay_stand_in_from if replayed else self.stand_in_from

    def padded_at(self, run: int, *, replayed: bool = False) -> float:
        """ms of the padded call at run length ``run`` (``padded_replay_ms`` where ``replayed``)."""
        return loglog_at(self.lengths, self.padded_replay_ms if replayed else self.padded_ms, run)

    def dense_at(self, rows: int, *, replayed: bool = False) -> float:
        """ms of the dense call over one sequence of ``rows`` rows as it runs (:meth:`run_rows`): at its bucket
        with the padded kernel (the exact one where no padding is needed), or at ``rows``; ``replayed``: between
        piecewise segments (the padded call's device time, :attr:`padded_replay_ms`)."""
        run = self.run_rows(rows, replayed=replayed)
        return self.ms_at(rows)[1] if run == rows else self.padded_at(run, replayed=replayed)

    def stand_in(self, rows: int, *, replayed: bool = False) -> tuple[int, float] | None:
        """``(bucket length, ms)`` of the padded call a dense call over a sequence of ``rows`` rows may run while its
        own length (its run length: below :meth:`bucket_start`) has no plan: from :meth:`stand_in_start`, at
        ``bucket_rows(rows)`` where that is longer than ``rows`` (a bucket length is its own run length) and the
        padded call beats the varlen kernel at ``rows`` (between measured lengths); else ``None``."""
        start = self.stand_in_start(replayed=replayed)
        if start is None or rows < start or self.run_rows(rows, replayed=replayed) != rows:
            return None
        bucket = bucket_rows(rows)
        if bucket == rows:
            return None
        ms = self.padded_at(bucket, replayed=replayed)
        return (bucket, ms) if ms < self.ms_at(rows)[0] else None

    def ms_at(self, rows: int) -> tuple[float, float]:
        """``(varlen ms, dense ms)`` of one call on one sequence of ``rows`` rows (the varlen kernel chosen):
        linear in log-log between the measured lengths, extended past the longest (and below the shortest) with
        the slope of the nearest pair (attention is quadratic, so about 2)."""
        return (loglog_at(self.lengths, self.chosen_varlen_ms, rows),
                loglog_at(self.lengths, self.dense_ms, rows))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``min_rows`` is written for readers and recomputed on load (``bucket_from``,
        ``replay_bucket_from``, the stand-in starts and ``varlen_kernel`` too)."""
        return {"device": self.device, "heads": self.heads, "head_dim": self.head_dim, "dtype": self.dtype,
                "lengths": list(self.lengths), "varlen_ms": list(self.varlen_ms), "dense_ms": list(self.dense_ms),
                "dense_first_ms": list(self.dense_first_ms), "padded_ms": list(self.padded_ms),
                "fa4_ms": list(self.fa4_ms), "padded_replay_ms": list(self.padded_replay_ms),
                "varlen_kernel": self.varlen_kernel, "min_rows": self.min_rows, "bucket_from": self.bucket_from,
                "replay_bucket_from": self.replay_bucket_from, "stand_in_from": self.stand_in_from,
                "replay_stand_in_from": self.replay_stand_in_from}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Crossover:
        check_mapping("Crossover.from_dict(data)", data, hint="Pass the dict Crossover.to_dict() returned.")
        derived = ("min_rows", "bucket_from", "replay_bucket_from", "stand_in_from", "replay_stand_in_from",
                   "varlen_kernel")
        fields = {k: v for k, v in data.items() if k not in derived}
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ConfigError(
                f"Crossover.from_dict(data): {exc}. Pass the dict Crossover.to_dict() returned."
            ) from None


def loglog_at(lengths: Sequence[int], times: Sequence[float], rows: int) -> float:
    """``times`` (one per ascending length) at ``rows``: linear in log-log between the measured lengths,
    extended past the longest (and below the shortest) with the slope of the nearest pair (2 with one length:
    attention is quadratic)."""
    if len(lengths) == 1:
        return times[0] * (rows / lengths[0]) ** 2
    i = min(max(bisect.bisect_right(lengths, rows) - 1, 0), len(lengths) - 2)
    x0, x1 = math.log(lengths[i]), math.log(lengths[i + 1])
    t = (math.log(max(rows, 1)) - x0) / (x1 - x0)
    y0, y1 = (math.log(max(v, 1e-9)) for v in (times[i], times[i + 1]))
    return math.exp(y0 + t * (y1 - y0))


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
