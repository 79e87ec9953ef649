"""The timed replay of ``benches/traffic.py``: every request of a trace through every system, in rotating order,
under one of the trace's sizes modes (``benches.lib.trace.SIZES_MODES``), recorded into the tower's document."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from benches.lib import traffic_report as report
from benches.lib.compiled import CapExceeded, TimeBox, counter_delta, dynamo_counters
from benches.lib.env import SKIPPED_TIME, Deadline, Env, free_memory, log, short_error
from benches.lib.results import Results
from benches.lib.systems import GRAPH_SYSTEMS, System, TowerBench
from benches.lib.timing import time_once
from benches.lib.trace import Caps, fresh_request, rows_of

__all__ = ["FLUSH_EVERY", "MAX_ERRORS", "TIME_BOXED", "Replay", "timed"]

TIME_BOXED = (System.HF_COMPILE_DYNAMIC,)
"""Systems bounded by a time box of their own, never dropped for time."""
MAX_ERRORS = 3
"""A system that fails on this many requests is dropped from the rest of the replay."""
FLUSH_EVERY = 25


def _order(systems: Sequence[System], index: int) -> list[System]:
    k = index % len(systems)
    return list(systems[k:]) + list(systems[:k])


def timed(bench: TowerBench, system: System, inputs: Any, env: Env, box: TimeBox | None) -> float:
    """Milliseconds of one call of ``system`` (inside its time box when it has one)."""
    fn = bench.call(system, inputs)
    if system in TIME_BOXED and box is not None:
        return time_once(lambda: box.run(fn), env)
    return time_once(fn, env)


class Replay:
    """The trace replay of one tower: latencies (NaN where a system failed or was stopped), errors, items and
    tokens per request; :meth:`record` writes their summaries into the tower's document (also every
    ``FLUSH_EVERY`` requests, so that a run killed from outside keeps what it measured)."""

    def __init__(self, bench: TowerBench, systems: list[System], box: TimeBox | None, *, warmed: dict[str, Any],
                 start: dict[str, Any], floor: Any = None, sizes: str = "as-drawn", seen: set[int] | None = None
                 ) -> None:
        self.bench, self.systems, self.box, self.floor = bench, systems, box, floor
        self.sizes, self.seen = sizes, seen if seen is not None else set()
        self.extra_tokens: dict[System, list[float]] = {s: [] for s in systems}
        self.reused = 0  # images of "new" for which no unseen size was found (kept as drawn)
        self.floors: list[dict[str, float]] = []  # at the first system's sizes (the request's, under "new")
        self.system_floors: dict[System, list[dict[str, float]]] = {s: [] for s in systems}  # "new": each its own
        self.counters = {"start": start, "warmed": warmed}
        self.latencies: dict[System, list[float]] = {s: [] for s in systems}
        self.errors: dict[System, int] = {s: 0 for s in systems}
        self.items: list[int] = []
        self.tokens: list[int] = []
        self.routes: dict[System, list[dict[str, Any]]] = {s: [] for s in systems if s in GRAPH_SYSTEMS}

    def stopped(self, system: System) -> bool:
        boxed = system in TIME_BOXED and self.box is not None and self.box.spent is not None
        return boxed or self.errors[system] >= MAX_ERRORS

    def run(self, trace: list[Any], caps: Caps, env: Env, deadline: Deadline, min_requests: int,
            doc: dict[str, Any], results: Results) -> None:
        """Every request through every system (rotating order) until the deadline, but at least
        ``min_requests``."""
        for s in (s for s in self.systems if s in GRAPH_SYSTEMS or s is System.ADAPTER_EAGER):
            self.bench.reset_stats(s)
        for index, request in enumerate(trace):
            if deadline.expired() and index >= min_requests:
                doc.setdefault("trace", {})["stopped"] = f"{SKIPPED_TIME} (after {index} requests)"
                break
            variants = self.variants(request, caps)
            inputs = {s: caps.inputs(self.bench, r, 100_000 + index) for s, r in variants.items()}
            # The first system's copy is the request as drawn where its sizes were new; under "new" the others
            # run the nearest sizes not seen yet, a few patch rows wider or narrower.
            first = inputs[self.systems[0]].sizes
            for s in _order(self.systems, index):
                if self.sizes == "seen":
                    self.one(s, inputs[s], env, index, doc)  # untimed: the timed run meets sizes it has seen
                before = self.bench.stats(s) if s in self.routes else None
                self.latencies[s].append(self.one(s, inputs[s], env, index, doc))
                if before is not None:  # how the timed call ran (its batches' budgets, eager reasons)
                    self.routes[s].append(report.route(before, self.bench.stats(s)))
                self.extra_tokens[s].append(inputs[s].sizes.tokens / max(first.tokens, 1) - 1.0)
            self.items.append(first.items)
            self.tokens.append(first.tokens)
            if self.floor is not None:
                self.floors.append(self.floor(first.grids))
                if self.sizes == "new":  # a few percent apart for the smallest images: each at its own sizes
                    for s in self.systems:
                        grids = inputs[s].sizes.grids
                        self.system_floors[s].append(self.floors[-1] if grids == first.grids else self.floor(grids))
            del inputs
            if len(self.items) % FLUSH_EVERY == 0:
                log(f"{self.bench.spec.name}: {len(self.items)}/{len(trace)} requests")
                self.record(doc)
                results.flush()
        self.record(doc)

    def variants(self, request: Any, caps: Caps) -> dict[System, Any]:
        """The copy of ``request`` each system runs: the same one, except under ``new`` (a fresh copy each, in
        the systems' order: the first gets the request as drawn where its sizes are new)."""
        if self.sizes != "new":
            self.seen.update(rows_of(request, self.bench.geom, caps))
            return {s: request for s in self.systems}
        out = {}
        for s in self.systems:
            out[s], reused = fresh_request(request, self.bench.geom, caps, self.seen)
            self.reused += reused
        return out

    def one(self, system: System, inputs: Any, env: Env, index: int, doc: dict[str, Any]) -> float:
        if self.stopped(system):
            return math.nan
        try:
            return timed(self.bench, system, inputs, env, self.box)
        except CapExceeded:
            pass
        except Exception as exc:
            self.errors[system] += 1
            doc.setdefault("errors", {}).setdefault(system.value, []).append(f"request {index}: {short_error(exc)}")
        free_memory()
        return math.nan

    def floor_lists(self) -> tuple[Any, Any]:
        """``(floor ms, shape floor ms)`` per request as :func:`report.summarize` takes them: one list each, or
        under ``new`` one per system at the sizes it ran; ``None`` for a floor not computed."""
        def lists(key: str) -> Any:
            if self.sizes == "new":
                per = {s: [round(f.get(key, math.nan), 4) for f in v] for s, v in self.system_floors.items()}
                return per if any(math.isfinite(x) for v in per.values() for x in v) else None
            flat = [f.get(key, math.nan) for f in self.floors]
            return flat if any(math.isfinite(x) for x in flat) else None

        if not self.floors:
            return None, None
        return lists("floor_ms"), lists("shape_floor_ms")

    def record(self, doc: dict[str, Any]) -> None:
        doc.setdefault("trace", {})["completed"] = len(self.items)
        doc["sizes"] = self.sizes
        doc["per_request"] = {"items": self.items, "tokens": self.tokens, "latency_ms": {
            s.value: [round(x, 4) if math.isfinite(x) else None for x in v] for s, v in self.latencies.items()}}
        if self.sizes == "new":  # each system's copy against the first's (the tokens above)
            doc["per_request"]["extra_tokens"] = {s.value: [round(x, 5) for x in v]
                                                  for s, v in self.extra_tokens.items()}
            doc["per_request"]["sizes_reused"] = self.reused
        if self.floors:
            doc["per_request"]["floor"] = self.floors
        if self.routes:
            doc["per_request"]["routes"] = {s.value: v for s, v in self.routes.items()}
        floors, shape = self.floor_lists()
        if floors is not None and self.sizes == "new":
            doc["per_request"]["system_floors"] = {
                s.value: {"floor_ms": floors[s], **({"shape_floor_ms": shape[s]} if shape is not None else {})}
                for s in self.systems}
        doc["systems"] = report.summarize(self.latencies, self.errors, floors, shape)
        for s in (s for s in self.systems if s in GRAPH_SYSTEMS):
            doc.setdefault("graph_stats", {})[s.value] = report.graph_stats(self.bench.stats(s))
        if self.box is not None:
            now, c = dynamo_counters(), self.counters
            doc["compile_dynamic"] = {"warmup": counter_delta(c["warmed"], c["start"]),
                                      "trace": counter_delta(now, c["warmed"]),
                                      "total": counter_delta(now, c["start"]), **self.box.summary()}
