"""The cost model checked while serving: measured runs against predicted ones, and the model corrected.

A cost model is measured once, at capture. Measured under contention (another process capturing on the same GPU)
it can be wrong for the runner's whole life: a server whose replays were timed slow sent every item eagerly
("eager is cheaper") for good. So the runner times a sample of what it runs and compares it with what its model
predicted:

- every :data:`SAMPLE_EVERY`-th run of each path and kind (a replay, or an eager forward) is bracketed by two
  timing events, recorded on the current stream of the runner's device (CUDA events; on the CPU, host clock
  readings). Nothing waits for them: the events are read on a later call, and only once ``query()`` says they
  completed, so timing never syncs the host (a sample not complete yet stays pending);
- a batch the model sends eagerly because eager looked cheaper (``EagerReason.COST``) while a captured budget would
  hold it replays instead once in :data:`EXPLORE_EVERY` such batches (timed): without that, a model that prices
  replays too high would never see a replay again;
- per path and kind, once :data:`MIN_SAMPLES` ratios ``measured / predicted`` were read since the last correction,
  their median ``m`` outside ``[1 / THRESHOLD, THRESHOLD]`` multiplies that part of the model by ``m``
  (:meth:`~encgraph.packing.CostModel.scaled`): replay times and the attention term for ``graph``, the eager
  curve for ``eager``. Samples of a part taken before that part was corrected are dropped;
- a model that replaces the runner's (``recapture``, ``measure_costs``, an assigned ``runner.costs``) is checked
  from scratch (:meth:`CostFeedback.reset`): nothing measured against the old model carries over.

**Bound.** Under steady conditions a part of the model that is off by more than :data:`THRESHOLD` is corrected
after at most ``SAMPLE_EVERY * MIN_SAMPLES`` runs of that kind on that path (``EXPLORE_EVERY * MIN_SAMPLES``
"eager is cheaper" batches for replays the model avoids), plus one call to read the last sample: 32 runs (64
batches) with the defaults. One correction scales that part by the median measured/predicted ratio (one factor per
path and kind, every budget alike); a further one follows only if the conditions change again.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch

from encgraph.packing import CostModel, ItemSpec
from encgraph.packing.attention_term import item_term

__all__ = [
    "CostFeedback", "RunKind", "HostEvent", "DeviceEvent", "predicted_ms", "event_factory", "SAMPLE_EVERY",
    "EXPLORE_EVERY", "MIN_SAMPLES", "THRESHOLD",
]

SAMPLE_EVERY = 8
"""One timed run in this many, per path and kind (the first run is timed)."""
EXPLORE_EVERY = 16
"""One replay in this many batches sent eagerly as cheaper while a captured budget holds them."""
MIN_SAMPLES = 4
"""Ratios read before a part of the model may be corrected."""
THRESHOLD = 1.25
"""A median ratio beyond this factor (either way) corrects the model."""
MAX_PENDING = 64
"""Samples waiting for their events; older ones are dropped (a device that never completes them)."""


def holding_budget(path: str, ladder: Sequence[int], specs: Sequence[ItemSpec], limits: Any) -> int | None:
    """The smallest budget of ``ladder`` (ascending) that holds ``specs`` on ``path`` within ``limits``
    (``max_items``, ``max_frames``); ``None`` where none does."""
    tokens = sum(s.tokens[path] for s in specs)
    if len(specs) > limits.max_items or sum(s.frames for s in specs) > limits.max_frames:
        return None
    return next((b for b in ladder if b >= tokens > 0), None)


def predicted_ms(costs: CostModel, path: str, budget: int | None, specs: Sequence[ItemSpec]) -> float:
    """What ``costs`` predicts for running ``specs`` on ``path``: eagerly (``budget`` ``None``) or replaying
    ``budget``, the replay priced by its content (the attention term) as the cost-aware planner prices it."""
    tokens = sum(s.tokens[path] for s in specs)
    items = sum(1 for s in specs if s.tokens[path])
    if budget is None:
        return costs.eager_cost(path, tokens, items)
    power = costs.power(path)
    squares = sum(item_term(s.tokens[path], s.frames, power) for s in specs) + item_term(budget - tokens, 1, power)
    return costs.graph_cost(path, budget, squares)


class RunKind(enum.Enum):
    """What a timed run was."""

    GRAPH = "graph"
    EAGER = "eager"


class HostEvent:
    """A timing event on the host clock, with the CUDA event's interface (``record``, ``query``, ``elapsed_time``
    in ms): on the CPU a run is over when the call returns."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.t - self.t) * 1e3


class DeviceEvent:
    """A CUDA timing event recorded on the current stream of ``device`` (an indexed CUDA device), whichever device
    is current: a runner on ``cuda:1`` called while ``cuda:0`` is current runs its work on ``cuda:1``'s stream (its
    tensors' and its graphs' device), and an event recorded on ``cuda:0``'s would time nothing of it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.event = torch.cuda.Event(enable_timing=True)

    def record(self) -> None:
        self.event.record(torch.cuda.current_stream(self.device))

    def query(self) -> bool:
        return self.event.query()

    def elapsed_time(self, end: DeviceEvent) -> float:
        return self.event.elapsed_time(end.event)


def event_factory(device: torch.device) -> Callable[[], Any]:
    """CUDA timing events on ``device``'s stream (:class:`DeviceEvent`) on a CUDA device, host clock events
    elsewhere."""
    if device.type == "cuda":
        return lambda: DeviceEvent(device)
    return HostEvent


@attrs.define(eq=False)
class _Sample:
    path: str
    kind: RunKind
    predicted_ms: float
    generation: int
    start: Any
    end: Any


class CostFeedback:
    """Samples runs, reads their timing events on later calls, and corrects a :class:`CostModel` (see the module
    docs). The runner's lock guards it; ``events`` makes timing events (tests pass fakes)."""

    def __init__(self, events: Callable[[], Any], *, sample_every: int = SAMPLE_EVERY,
                 explore_every: int = EXPLORE_EVERY, min_samples: int = MIN_SAMPLES, threshold: float = THRESHOLD) -> None:
        self.events = events
        self.sample_every = sample_every
        self.explore_every = explore_every
        self.min_samples = min_samples
        self.threshold = threshold
        self.generation: collections.Counter[tuple[str, RunKind]] = collections.Counter()
        self._runs: collections.Counter[tuple[str, RunKind]] = collections.Counter()
        self._cheaper: collections.Counter[str] = collections.Counter()
        self._forced: set[str] = set()
        self._pending: collections.deque[_Sample] = collections.deque(maxlen=MAX_PENDING)
        self._ratios: dict[tuple[str, RunKind], list[float]] = collections.defaultdict(list)
        self.samples = 0
        self.explored = 0
        self.unchosen = 0
        """Eager runs not timed because the model did not choose them (``chosen=False`` in :meth:`timed`)."""
        self.corrections: collections.Counter[str] = collections.Counter()
        self.scale: dict[str, dict[str, float]] = {}

    def sampled(self, path: str, kind: RunKind) -> bool:
        """Count a run of ``kind`` on ``path``; whether to time it."""
        n = self._runs[(path, kind)]
        self._runs[(path, kind)] = n + 1
        return n % self.sample_every == 0

    def explore(self, path: str, ladder: Sequence[int], specs: Sequence[ItemSpec], limits: Any) -> int | None:
        """Count a batch that the model sends eagerly as cheaper; once in :attr:`explore_every`, the smallest
        budget of ``ladder`` (those usable) that holds it within ``limits``, to replay it instead (else ``None``)."""
        n = self._cheaper[path]
        self._cheaper[path] = n + 1
        if n % self.explore_every != self.explore_every - 1:
            return None
        budget = holding_budget(path, ladder, specs, limits)
        if budget is not None:
            self.explored += 1
            self._forced.add(path)  # an explored replay is always timed: it is what the model lacks
        return budget

    @contextlib.contextmanager
    def timed(self, costs: CostModel | None, path: str, budget: int | None, specs: Sequence[ItemSpec], *,
              chosen: bool = True) -> Iterator[None]:
        """Around one run of ``specs`` on ``path`` (a replay of ``budget``, or eager for ``None``): time it when
        there is a model to check and the run is sampled.

        ``chosen=False``: an eager run the model did not choose (tokens over the largest budget, frames over
        ``max_frames``). It is never timed, only counted in :attr:`unchosen`: such items lie past the eager
        curve's last sample, where the curve is extrapolated (measured on the H200: a 7,081-token Qwen3-VL item
        took 1.4x its straight-line price), and their ratios would scale every eager price up, so that the
        planner replays mid-size batches that eager runs faster. No choice depends on their price."""
        kind = RunKind.EAGER if budget is None else RunKind.GRAPH
        if kind is RunKind.EAGER and not chosen:
            self.unchosen += 1
            yield
            return
        forced = kind is RunKind.GRAPH and path in self._forced
        self._forced.discard(path)
        if costs is None or not (forced or self.sampled(path, kind)):
            yield
            return
        sample = self.start(path, kind, predicted_ms(costs, path, budget, specs))
        yield
        self.stop(sample)

    def start(self, path: str, kind: RunKind, predicted_ms: float) -> _Sample:
        """Record the start event of a timed run (before its work is queued)."""
        sample = _Sample(path, kind, float(predicted_ms), self.generation[(path, kind)], self.events(), self.events())
        sample.start.record()
        return sample

    def stop(self, sample: _Sample) -> None:
        """Record the end event (after the run's work is queued); read on a later :meth:`poll`."""
        sample.end.record()
        self._pending.append(sample)

    def poll(self, costs: CostModel) -> CostModel | None:
        """Read every completed sample (never waits); the corrected model, or ``None`` where nothing changed."""
        waiting: collections.deque[_Sample] = collections.deque(maxlen=MAX_PENDING)
        while self._pending:
            sample = self._pending.popleft()
            if sample.generation != self.generation[(sample.path, sample.kind)]:
                continue  # predicted by a model since corrected
            if not sample.end.query():
                waiting.append(sample)
                continue
            self.samples += 1
            ms = sample.start.elapsed_time(sample.end)
            if sample.predicted_ms > 0 and ms > 0:
                self._ratios[(sample.path, sample.kind)].append(ms / sample.predicted_ms)
        self._pending = waiting
        factors: dict[RunKind, dict[str, float]] = {RunKind.GRAPH: {}, RunKind.EAGER: {}}
        for (path, kind), ratios in self._ratios.items():
            if len(ratios) < self.min_samples:
                continue
            m = statistics.median(ratios)
            ratios.clear()
            if not 1 / self.threshold <= m <= self.threshold:
                factors[kind][path] = m
        if not any(factors.values()):
            return None
        for kind, table in factors.items():
            for path, m in table.items():
                self.corrections[kind.value] += 1
                entry = self.scale.setdefault(path, {"graph": 1.0, "eager": 1.0})
                entry[kind.value] *= m
                self.generation[(path, kind)] += 1
        return costs.scaled(graph=factors[RunKind.GRAPH], eager=factors[RunKind.EAGER])

    def reset(self) -> None:
        """Forget what was learned about the model in use: samples still pending, ratios not yet acted on, the run
        and exploration counts and the cumulative ``scale``. The runner calls it whenever it replaces its cost model
        (``recapture``, ``measure_costs``, assigning ``runner.costs``): a ratio measured against one model's
        prediction says nothing about another's, and the new model is checked from its first run. The totals
        (``samples``, ``explored``, ``corrections``) are kept: they count what happened (counters never go back)."""
        self._pending.clear()
        self._ratios.clear()
        self._runs.clear()
        self._cheaper.clear()
        self._forced.clear()
        self.scale.clear()

    def as_dict(self) -> dict[str, Any]:
        """``samples`` read, ``explored`` replays, ``unchosen`` eager runs not timed, ``corrections`` per kind,
        cumulative ``scale`` per path."""
        return {
            "samples": self.samples,
            "explored": self.explored,
            "unchosen": self.unchosen,
            "corrections": dict(self.corrections),
            "scale": {p: {k: round(v, 4) for k, v in e.items()} for p, e in self.scale.items()},
        }
