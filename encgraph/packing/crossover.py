"""The measured attention kernels of one head geometry on one device: part of the cost model's JSON.

Every attention call inside a graph runs one packed varlen kernel, the fastest measured (:func:`faster_varlen`):
FlashAttention-4 or cuDNN's packed SDPA (through NVIDIA's frontend) where installed, else torch's Flash varlen;
eager calls run the faster of Flash and FlashAttention-4 (cuDNN builds a plan per shape: graphs only). An eager
forward knows its sequences on the host, so it may run a long one as a dense SDPA call (cuDNN on an H100 or H200:
350-430 TF/s at head dim 72-80, against Flash varlen's 210-260), as the tower's own forward does. The dense kernel
builds a plan for every new length on its first call (cuDNN: 35-65 ms), so a sequence runs dense only from the
length at which one forward's saving over its full-attention calls pays that plan (:meth:`Crossover.dense_from`): no
length new to the process then costs more than on varlen, and nothing is remembered per length. Measured at capture
(:func:`encgraph.models.kernel_choice.measure_crossover`); the cost model (:class:`~encgraph.packing.CostModel`,
field ``kernels``) stores it so that a saved model carries it too. Pure Python: importing it never imports torch.

>>> c = Crossover("NVIDIA H200", 16, 72, "bfloat16", (1024, 4096, 16384), (0.05, 0.4, 5.5), (0.06, 0.3, 3.5),
...               dense_first_ms=(35.06, 35.3, 38.5))
>>> c.min_rows, c.key, c.plan_ms, c.dense_from(27)
(4096, 'NVIDIA H200/16x72/bfloat16', 35.0, 13337)
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

__all__ = ["KERNEL_MARGIN", "Crossover", "crossover_rows", "faster_varlen", "kernel_key", "kernel_table", "loglog_at"]

KERNEL_MARGIN = 0.95
"""Another kernel runs a geometry's varlen calls where its median time over the measured lengths is at most this
share of torch's Flash kernel's (:func:`faster_varlen`): a measured 5% at least, so that run-to-run noise does not
swap kernels between captures of one build."""

_RETIRED = ("padded_ms", "padded_replay_ms", "bucket_from", "replay_bucket_from", "stand_in_from",
            "replay_stand_in_from")
"""Keys of cost models saved before dense plans left the graphs (ignored on load)."""


def kernel_key(device: str, heads: int, head_dim: int, dtype: str) -> str:
    """``"<device name>/<heads>x<head_dim>/<dtype>"``: what a crossover is measured for."""
    return f"{device}/{heads}x{head_dim}/{dtype}"


def faster_varlen(flash_ms: Sequence[float], fa4_ms: Sequence[float], cudnn_ms: Sequence[float] = ()) -> str:
    """Of the kernels measured (``fa4_ms``, ``cudnn_ms``: one time per length, or empty), the one whose median
    ratio to torch's Flash kernel over the lengths is lowest, where it is at most :data:`KERNEL_MARGIN`; else
    ``"flash"``.

    >>> faster_varlen([1.0, 2.0, 4.0], [0.7, 1.3, 2.6]), faster_varlen([1.0, 2.0], [0.99, 1.9])
    ('fa4', 'flash')
    >>> faster_varlen([1.0, 2.0], [0.8, 1.6], [0.6, 1.3]), faster_varlen([1.0], [])  # cuDNN fastest; none measured
    ('cudnn', 'flash')
    """
    ratios = {name: statistics.median(t / v for v, t in zip(flash_ms, times))
              for name, times in (("fa4", fa4_ms), ("cudnn", cudnn_ms)) if times}
    best = min(ratios, key=ratios.__getitem__, default=None)
    return best if best is not None and ratios[best] <= KERNEL_MARGIN else "flash"


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


def _optional_times(name: str) -> Any:
    return attrs.field(default=(), kw_only=True, converter=lambda v: _times(f"Crossover({name})", v) if v else ())


DENSE_LIMIT = 1 << 20
"""The longest sequence :meth:`Crossover.dense_from` looks at (rows): where one forward's saving has not paid a
plan by then, dense never runs."""


@attrs.frozen
class Crossover:
    """One measurement: per sequence length, the ms of one sequence through each kernel.

    Attributes:
        device: the device's name (``torch.cuda.get_device_name``); a model loaded on another device is measured
            again.
        heads, head_dim, dtype: the head geometry and dtype measured (``"bfloat16"``).
        lengths: rows of the one sequence, ascending.
        varlen_ms, dense_ms: per length, torch's Flash varlen kernel (replayed from a CUDA graph) and dense SDPA in
            the towers' own layout (calls issued back to back).
        dense_first_ms: the dense kernel's first call at a length new to the thread (cuDNN builds its plan), or
            empty; :attr:`plan_ms` is derived from it.
        fa4_ms: per length, FlashAttention-4's varlen kernel (the optional ``flash-attn-4`` wheel:
            :mod:`encgraph.models.fa4`), or empty (not installed, or not measured).
        cudnn_ms: per length, cuDNN's packed SDPA (the optional ``nvidia-cudnn-frontend`` wheel:
            :mod:`encgraph.models.cudnn_varlen`; replayed from a CUDA graph), or empty.
        graph_kernel: derived: the fastest of the three (:func:`faster_varlen`); the geometry's calls in captured
            graphs run it.
        varlen_kernel: derived: ``"fa4"`` where FlashAttention-4 was measured faster than torch's Flash kernel
            (:func:`faster_varlen` of those two), else ``"flash"``; the geometry's eager varlen calls run it.
        min_rows: derived (:func:`crossover_rows`): from how many rows the dense kernel beats the varlen kernel
            chosen, its plan aside; ``None``: never.
    """

    device: str = attrs.field(converter=lambda v: check_str("Crossover(device)", v))
    heads: int = attrs.field(converter=lambda v: check_int("Crossover(heads)", v, minimum=1))
    head_dim: int = attrs.field(converter=lambda v: check_int("Crossover(head_dim)", v, minimum=1))
    dtype: str = attrs.field(converter=lambda v: check_str("Crossover(dtype)", v))
    lengths: tuple[int, ...] = attrs.field(converter=lambda v: _ints("Crossover(lengths)", v))
    varlen_ms: tuple[float, ...] = attrs.field(converter=lambda v: _times("Crossover(varlen_ms)", v))
    dense_ms: tuple[float, ...] = attrs.field(converter=lambda v: _times("Crossover(dense_ms)", v))
    dense_first_ms: tuple[float, ...] = _optional_times("dense_first_ms")
    fa4_ms: tuple[float, ...] = _optional_times("fa4_ms")
    cudnn_ms: tuple[float, ...] = _optional_times("cudnn_ms")
    graph_kernel: str = attrs.field(init=False)
    varlen_kernel: str = attrs.field(init=False)
    min_rows: int | None = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        for name in ("varlen_ms", "dense_ms", "dense_first_ms", "fa4_ms", "cudnn_ms"):
            times = getattr(self, name)
            if len(times) != len(self.lengths) and (times or name in ("varlen_ms", "dense_ms")):
                raise ConfigError(
                    f"Crossover({name}): expected one time per length ({len(self.lengths)}), got {len(times)}."
                )
        object.__setattr__(self, "graph_kernel", faster_varlen(self.varlen_ms, self.fa4_ms, self.cudnn_ms))
        object.__setattr__(self, "varlen_kernel", faster_varlen(self.varlen_ms, self.fa4_ms))
        object.__setattr__(self, "min_rows", crossover_rows(self.lengths, self.chosen_varlen_ms, self.dense_ms))

    @property
    def key(self) -> str:
        return kernel_key(self.device, self.heads, self.head_dim, self.dtype)

    @property
    def chosen_varlen_ms(self) -> tuple[float, ...]:
        """Per length, the ms of the varlen kernel this geometry's eager calls run (:attr:`varlen_kernel`)."""
        return self.fa4_ms if self.varlen_kernel == "fa4" else self.varlen_ms

    @property
    def plan_ms(self) -> float:
        """What the dense kernel's first call at a new length costs beyond its later calls (the median over the
        measured lengths of ``dense_first_ms - dense_ms``, at least 0): cuDNN building the plan of that shape.
        0.0 when no first calls were recorded."""
        if not self.dense_first_ms:
            return 0.0
        return max(statistics.median(f - d for f, d in zip(self.dense_first_ms, self.dense_ms)), 0.0)

    def ms_at(self, rows: int) -> tuple[float, float]:
        """``(varlen ms, dense ms)`` of one call on one sequence of ``rows`` rows (the varlen kernel chosen), as
        :func:`loglog_at` interpolates them."""
        return (loglog_at(self.lengths, self.chosen_varlen_ms, rows), loglog_at(self.lengths, self.dense_ms, rows))

    def dense_from(self, calls: int) -> int | None:
        """Rows from which an eager forward with ``calls`` attention calls per sequence (the tower's
        full-attention layers) runs a sequence on the dense kernel: from :attr:`min_rows`, the first length (in
        steps of 1/64 of a doubling) whose saving over the ``calls`` calls pays :attr:`plan_ms`, and every longer
        one (the saving grows with the rows); ``None`` where none up to :data:`DENSE_LIMIT` rows does."""
        if self.min_rows is None:
            return None
        rows = float(self.min_rows)
        while rows <= DENSE_LIMIT:
            varlen, dense = self.ms_at(math.ceil(rows))
            if calls * (varlen - dense) >= self.plan_ms:
                return math.ceil(rows)
            rows *= 2 ** (1 / 64)
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``graph_kernel``, ``varlen_kernel`` and ``min_rows`` are written for readers and recomputed
        on load."""
        return {"device": self.device, "heads": self.heads, "head_dim": self.head_dim, "dtype": self.dtype,
                "lengths": list(self.lengths), "varlen_ms": list(self.varlen_ms), "dense_ms": list(self.dense_ms),
                "dense_first_ms": list(self.dense_first_ms), "fa4_ms": list(self.fa4_ms),
                "cudnn_ms": list(self.cudnn_ms), "graph_kernel": self.graph_kernel,
                "varlen_kernel": self.varlen_kernel, "min_rows": self.min_rows}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Crossover:
        check_mapping("Crossover.from_dict(data)", data, hint="Pass the dict Crossover.to_dict() returned.")
        fields = {k: v for k, v in data.items() if k not in ("min_rows", "graph_kernel", "varlen_kernel", *_RETIRED)}
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
