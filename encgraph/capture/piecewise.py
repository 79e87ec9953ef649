"""Piecewise replays: one budget's forward captured as the graphs *between* its long attention calls, each such
call run eagerly between two replays with the host's sequence bounds, so that a long sequence attends on the
per-sequence kernel (dense SDPA: cuDNN on an H200, about 1.6x Flash varlen's rate at head dim 72-80) and the
padding does not attend at all, while the rest of each layer still replays without launches.

Why: a whole graph attends with the one kernel it captured (Flash varlen over the budget's rows), whatever the
batch holds. A batch of one 5,000-row image replayed at budget 1280 took 28.9 ms on an H200 where the eager
forward, on cuDNN's kernel, took 22.6 (``docs/benchmarks.md``); a dense call inside the graph attends the padding
too and gains little (``counted_dense``). vLLM's piecewise CUDA graphs for language models split the same way.

Mechanics (GRAPH mode, at capture, after a budget's whole graph): the adapter's attention op, called while a
:class:`Splitter` is active and the stream captures, offers each call it would run dense for long sequences
(:func:`splitter`; the op decides, from its measured crossover, and hands a :class:`PieceAttention`). The splitter
then

1. copies the call's query, key and value into static tensors (captured, the last kernels of the segment),
2. ends the segment's graph and begins the next one in the same memory pool,
3. returns, as the call's output, a copy of a static output tensor made by the next segment's first kernel.

A replay (:meth:`PiecewiseRecord.replay`) runs segment, attention, segment, ...; the attention reads the static
query/key/value and writes the static output, with the bounds the fill just wrote (``PathBuffers.host_bounds``).
The static tensors are allocated once per head geometry at the path's largest piecewise budget, outside the
pool, and shared by every site and budget (sites run one after the other). The graphs share the runner's pool
and are replayed in the order they were captured. Nothing in a segment reads the host.

Which batches replay piecewise (:meth:`PiecewiseRecord.pays`): where the attention the host bounds would move to
the dense kernel saves more than the split costs, both measured: the saving per sequence from the crossover
(:meth:`PieceAttention.gain_ms`), the cost at capture (:attr:`PiecewiseRecord.overhead_ms`: the piecewise replay
with every call on varlen, against the whole graph, on the same fill).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import torch

from encgraph.capture.grad import persistent
from encgraph.capture.timing import time_interleaved
from encgraph.packing.kernels import LEDGER

__all__ = ["PieceAttention", "PiecewiseRecord", "Site", "Splitter", "Statics", "active", "splitter", "trim_bounds",
           "warm_plans"]

log = logging.getLogger("encgraph")

_SPLITTER: contextvars.ContextVar[Splitter | None] = contextvars.ContextVar("encgraph_splitter", default=None)


def splitter() -> Splitter | None:
    """The splitter of the capture running in this thread, or ``None`` (the usual case: then every attention call
    runs as it always does)."""
    return _SPLITTER.get()


@contextlib.contextmanager
def active(split: Splitter) -> Iterator[Splitter]:
    """Inside the block, attention ops offer their calls to ``split``."""
    token = _SPLITTER.set(split)
    try:
        yield split
    finally:
        _SPLITTER.reset(token)


class PieceAttention(Protocol):
    """One attention call of a piecewise forward, as the adapter's attention op hands it to :meth:`Splitter.offer`."""

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
            bounds: Sequence[int], out: torch.Tensor, dense: bool) -> None:
        """Write the attention of the real sequences ``bounds`` (host ints ``[0, e1, ..., ek]``, the rows past ``ek``
        padding) into ``out`` (``query``'s shape); ``dense=False``: every sequence on the varlen kernel."""

    def gain_ms(self, bounds: Sequence[int]) -> float:
        """ms this call saves over the whole graph's varlen call with ``bounds`` (long sequences on dense)."""

    def warm(self, rows: int, device: torch.device) -> dict[str, Any]:
        """Build, in this thread, the kernel plans calls of up to ``rows`` rows will need (capture time); returns
        ``{"lengths": plans built, "seconds": wall time}``."""


def trim_bounds(full: np.ndarray, real_end: int) -> tuple[int, ...]:
    """The real sequences of a filled ``cu_seqlens`` buffer: its entries up to the first ``real_end`` (the
    padding sequences and the repeated ends after it dropped).

    >>> trim_bounds(np.array([0, 5, 9, 17, 20, 20]), 9), trim_bounds(np.array([0, 5, 9, 9, 9]), 9)
    ((0, 5, 9), (0, 5, 9))
    """
    stop = int(np.searchsorted(full, real_end, side="left")) + 1
    return tuple(int(x) for x in full[:stop])


@attrs.define(eq=False)
class Site:
    """One attention call between two segments. ``query``/``key``/``value``/``out``: views of the static tensors
    at this budget's rows, written by the segment before it (query/key/value) and by the attention (``out``);
    ``cu_seqlens``: the static buffer view the call attends by; ``bounds_name``: that buffer's name."""

    bounds_name: str
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    out: torch.Tensor
    cu_seqlens: torch.Tensor
    attention: PieceAttention


class Statics:
    """The static query/key/value/output tensors of one path, one set per head geometry and dtype, ``rows`` rows
    each (the path's largest piecewise budget); allocated before a capture (never inside one)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows = rows
        self.device = device
        self.sets: dict[tuple[Any, ...], tuple[torch.Tensor, ...]] = {}

    def reserve(self, shapes: Sequence[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]) -> None:
        """Allocate the sets of ``shapes`` (``(query trailing shape, key trailing shape, dtype)``) not held yet."""
        with persistent():
            for q_shape, k_shape, dtype in shapes:
                if (q_shape, k_shape, dtype) not in self.sets:
                    self.sets[(q_shape, k_shape, dtype)] = tuple(
                        torch.empty((self.rows, *s), dtype=dtype, device=self.device)
                        for s in (q_shape, k_shape, k_shape, q_shape)
                    )

    def views(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        held = self.sets.get((tuple(query.shape[1:]), tuple(key.shape[1:]), query.dtype))
        if held is None or query.shape[0] > self.rows:
            return None
        n = query.shape[0]
        return tuple(t[:n] for t in held)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for held in self.sets.values() for t in held)


class Splitter:
    """The state of one piecewise capture (``discover=False``) or of the discovery that precedes it, run inside
    the budget's whole-graph capture (``discover=True``: every call is only noted, nothing splits)."""

    def __init__(self, bounds_views: Mapping[str, torch.Tensor], table: Any, *, discover: bool,
                 statics: Statics | None = None, pool: Any = None) -> None:
        self.bounds_views = dict(bounds_views)
        self.table = table
        """The adapter's ``kernel_rows`` (which sequences run dense, per head geometry): the op reads it."""
        self.discover = discover
        self.statics = statics
        self.pool = pool
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]] = []  # discovered
        self.rows = 0  # the most rows a discovered call had
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.sites: list[Site] = []
        self.refused: str | None = None  # why a call could not split (the record is then not used)

    def _bounds_name(self, cu: torch.Tensor) -> str | None:
        for name, view in self.bounds_views.items():
            if view.data_ptr() == cu.data_ptr() and view.numel() == cu.numel():
                return name
        return None

    def offer(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
              attention: PieceAttention) -> torch.Tensor | None:
        """Called by an attention op inside a capture for a call it would split. Returns the call's output
        (splitting: a copy of the static output, the next segment's first kernel), or ``None`` where the call
        runs inside the graph as usual (discovery; or a call that cannot split, noted in :attr:`refused`)."""
        name = self._bounds_name(cu_seqlens)
        if name is None:
            self.refused = self.refused or "an attention call's cu_seqlens is not one of the path's bounds buffers"
            return None
        if self.discover:
            self.shapes.append((tuple(query.shape[1:]), tuple(key.shape[1:]), query.dtype))
            self.rows = max(self.rows, int(query.shape[0]))
            return None
        held = self.statics.views(query, key) if self.statics is not None else None
        if held is None or self.refused:
            self.refused = self.refused or "an attention call's shape was not seen at discovery"
            return None
        q, k, v, o = held
        q.copy_(query)
        k.copy_(key)
        v.copy_(value)
        self.graphs[-1].capture_end()
        # One object per kind of call (equal calls: the same geometry, rule and scale), so that a replay prices
        # each kind once (PiecewiseRecord.gain_ms), not once per layer.
        attention = next((s.attention for s in self.sites if s.attention == attention), attention)
        self.sites.append(Site(name, q, k, v, o, cu_seqlens, attention))
        self.begin()
        return o.clone()

    def begin(self) -> None:
        """Begin the next segment's capture on the current stream, in the pool."""
        graph = torch.cuda.CUDAGraph()
        self.graphs.append(graph)
        graph.capture_begin(pool=self.pool)


@attrs.define(eq=False)
class PiecewiseRecord:
    """A budget's forward as ``len(sites) + 1`` graphs with an eager attention call between each two. It writes
    the same output buffers as the budget's whole graph (valid until the next replay of the path).

    ``whole_ms``/``dense_ms``/``varlen_ms``: at capture, on one fill of random floats whose bounds buffers hold
    one sequence over the budget's rows, the whole graph's replay, the piecewise replay with long sequences
    dense, and with every call on varlen (ms, host-seen minimum); ``overhead_ms = max(varlen_ms - whole_ms, 0)``.
    """

    path: str
    budget: int
    graphs: list[torch.cuda.CUDAGraph]
    sites: list[Site]
    capture_seconds: float
    whole_ms: float | None = None
    dense_ms: float | None = None
    varlen_ms: float | None = None

    @property
    def overhead_ms(self) -> float:
        if self.varlen_ms is None or self.whole_ms is None:
            return float("inf")
        return max(self.varlen_ms - self.whole_ms, 0.0)

    def site_bounds(self, host_bounds: Mapping[str, tuple[np.ndarray, int]]) -> list[tuple[int, ...]]:
        """Per site, its real sequences in the fill ``host_bounds`` (``PathBuffers.host_bounds``); each buffer's
        trimmed once, the sites that attend by it share the tuple."""
        trimmed = {name: trim_bounds(*host_bounds[name]) for name in {site.bounds_name for site in self.sites}}
        return [trimmed[site.bounds_name] for site in self.sites]

    def gain_ms(self, bounds: Sequence[Sequence[int]]) -> float:
        """ms the sites' attention would save over the whole graph's on ``bounds`` (per site): each kind of call
        (one attention object) on each bounds tuple priced once, however many layers share them."""
        priced: dict[tuple[int, int], float] = {}
        total = 0.0
        for site, b in zip(self.sites, bounds):
            key = (id(site.attention), id(b))
            if key not in priced:
                priced[key] = site.attention.gain_ms(b)
            total += priced[key]
        return total

    def pays(self, bounds: Sequence[Sequence[int]]) -> bool:
        """Whether this fill replays faster piecewise: the saving beats the measured overhead."""
        return self.gain_ms(bounds) > self.overhead_ms

    def replay(self, bounds: Sequence[Sequence[int]], *, dense: bool = True) -> None:
        """Replay every segment with each site's attention between, on ``bounds`` (per site, host ints)."""
        graphs, sites = self.graphs, self.sites
        for i, site in enumerate(sites):
            graphs[i].replay()
            site.attention.run(site.query, site.key, site.value, site.cu_seqlens, bounds[i], site.out, dense)
        graphs[-1].replay()

    def summary(self) -> dict[str, Any]:
        def ms(v: float | None) -> float | None:
            return None if v is None else round(v, 4)

        return {"segments": len(self.graphs), "capture_seconds": round(self.capture_seconds, 4),
                "whole_ms": ms(self.whole_ms), "dense_ms": ms(self.dense_ms), "varlen_ms": ms(self.varlen_ms)}


def capture_piecewise(body: Callable[[], None], bounds_views: Mapping[str, torch.Tensor], table: Any,
                      statics: Statics, pool: Any, path: str, budget: int,
                      stream: torch.cuda.Stream) -> PiecewiseRecord | str:
    """Capture ``body`` (the budget's forward into its output buffers, as the whole graph captured it) split at its
    long attention calls (their static tensors reserved in ``statics`` by a discovery beforehand). Returns the
    record, or why it could not split. Raises what the capture raised (the caller ends what it left recording)."""
    t0 = time.perf_counter()
    split = Splitter(bounds_views, table, discover=False, statics=statics, pool=pool)
    device = stream.device
    torch.cuda.synchronize(device)
    with torch.cuda.stream(stream):
        split.begin()
        try:
            with active(split):
                body()
        except BaseException:
            with contextlib.suppress(Exception):  # the caller ends what is left (capture's _end_failed_capture)
                split.graphs[-1].capture_end()
            raise
        split.graphs[-1].capture_end()
    torch.cuda.synchronize(device)
    if split.refused:
        return split.refused
    if not split.sites:
        return "no attention call split"
    return PiecewiseRecord(path, budget, split.graphs, split.sites, time.perf_counter() - t0)


def warm_plans(records: Sequence[PiecewiseRecord], device: torch.device) -> dict[str, Any]:
    """Let each distinct kind of split call of ``records`` build its plans up to the most rows its sites hold
    (:meth:`PieceAttention.warm`), in this thread; returns the total ``{"lengths", "seconds"}``."""
    most: dict[int, tuple[PieceAttention, int]] = {}
    for record in records:
        for site in record.sites:
            _, rows = most.get(id(site.attention), (site.attention, 0))
            most[id(site.attention)] = (site.attention, max(rows, int(site.query.shape[0])))
    built, seconds = 0, 0.0
    for attention, rows in most.values():
        done = attention.warm(rows, device)
        built, seconds = built + int(done["lengths"]), seconds + float(done["seconds"])
    return {"lengths": built, "seconds": round(seconds, 3)}


def time_piecewise(record: PiecewiseRecord, whole: torch.cuda.CUDAGraph, device: torch.device,
                   repeats: int = 5) -> None:
    """Fill ``record``'s timings: the whole graph, piecewise dense and piecewise varlen, interleaved, on the
    buffers as the caller filled them (one sequence over the budget's rows: every row real for the piecewise
    replays too). Dense plans are bought at once (what the steady state runs; the first call builds them)."""
    bounds = [(0, int(site.query.shape[0])) for site in record.sites]
    with LEDGER.buying():
        times = time_interleaved(
            [whole.replay, lambda: record.replay(bounds), lambda: record.replay(bounds, dense=False)], repeats, device
        )
    record.whole_ms, record.dense_ms, record.varlen_ms = times
