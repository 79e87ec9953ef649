"""The runner: plan each call, fill static buffers, replay captured graphs (or run eagerly), hand results back.

Phases, in the order a runner lives through them:

1. construction - validate the adapter and options, fix the ladders and limits (no device work);
2. ``capture()`` - allocate each path's buffers at its largest budget, warm each budget's static forward up on
   a side stream, capture every budget into one shared memory pool, largest first (rule 10), time each replay;
   a budget whose capture fails is logged and dropped, the rest keep working;
3. ``__call__`` - item specs -> ``pack`` -> per batch: select the sub-batch, fill the buffers of its budget
   (every row, by the adapter's fill rules), replay (or run eagerly where no budget fits) -> per-item results
   as fresh tensors, in the caller's order.
"""

from __future__ import annotations

import collections
import contextlib
import os
import logging
import statistics
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from encgraph._validate import check_int, describe
from encgraph.capture.buffers import PathBuffers
from encgraph.capture.protocol import AdapterConfig, BudgetUnit, EncoderAdapter
from encgraph.capture.records import GraphRecord, RunMode
from encgraph.capture.stats import RunStats
from encgraph.errors import CaptureError, ConfigError, ConfigTypeError, EncgraphError, InputError
from encgraph.packing import (
    CostModel,
    ItemSpec,
    Limits,
    Plan,
    TunedLadder,
    budget_ladder,
    default_limits,
    normalize_ladders,
    pack,
    tune_ladder,
)

__all__ = ["EncoderGraphRunner", "CAPTURE_FAILED", "EAGER_MODE"]

log = logging.getLogger("encgraph")

CAPTURE_FAILED = "capture failed at that budget"
EAGER_MODE = "runner in eager mode"


class EncoderGraphRunner:
    """Capture an adapter's static-shape forward once per budget and replay it for batches of any size.

    Args:
        adapter: an :class:`~encgraph.capture.protocol.EncoderAdapter` (see ``encgraph.models.wrap``).
        budgets: the ladder of one path (an iterable of ints) or ``{path: ladder}``; default: per path,
            ``budget_ladder(min_budget, max_budget, allow_zero=allow_empty)`` from the adapter.
        max_items, max_frames: per-batch limits; defaults from :func:`encgraph.packing.default_limits`.
        device: must be where the adapter's tower lives; default the adapter's device.
        mode: :class:`RunMode`; default ``GRAPH`` on CUDA, ``STATIC`` on CPU.
        lazy: capture on the first call if ``capture()`` was not called (else that call raises).
        copy_outputs: results are fresh tensors (default). ``False``: zero-copy, results are views of the
            graphs' output buffers, **valid only until the next call** of this runner.
        warmup: eager runs of each budget's static forward on the side stream before its capture.
        progress: show a progress bar while capturing; default when stderr is a terminal.
        compile: before capturing a budget, compile its static forward with ``torch.compile`` (static shapes,
            inductor kernels, no cudagraphs of its own; one compile per budget) so the graph replays fused
            kernels. GRAPH mode only; compile seconds are reported with the capture.
        costs: a :class:`~encgraph.packing.CostModel` (or the path of one saved as JSON): plan each call with
            the cost-aware packer (batch splits and graph-vs-eager that minimise expected time). Measure one
            with ``measure_costs(samples)``; default: the greedy planner.
        record: keep the item specs of the last ``record`` calls (``observed``), for ``tune()``.
        process_group: a ``torch.distributed`` group (``torch.distributed.group.WORLD`` for all ranks): spread
            each call's items over its ranks (balanced by size), every rank returns every item in the caller's
            order (:class:`~encgraph.capture.distributed.DataParallelEncoder`). Every rank must get the same
            inputs and call ``capture()`` before its first call; ``global_stats()`` counts each item once.

    Thread safety: calls and ``capture()`` are serialised by a lock (one sub-batch at a time owns the static
    buffers); concurrent callers wait, they never interleave.
    """

    def __init__(
        self,
        adapter: EncoderAdapter,
        *,
        budgets: Iterable[int] | Mapping[str, Iterable[int]] | None = None,
        max_items: int | None = None,
        max_frames: int | None = None,
        device: torch.device | str | None = None,
        mode: RunMode | None = None,
        lazy: bool = True,
        copy_outputs: bool = True,
        warmup: int = 2,
        progress: bool | None = None,
        compile: bool = False,
        costs: CostModel | str | os.PathLike[str] | None = None,
        record: int = 0,
        process_group: Any = None,
    ) -> None:
        if not isinstance(adapter, EncoderAdapter):
            missing = [m for m in _ADAPTER_METHODS if not hasattr(adapter, m)]
            raise ConfigTypeError(
                f"adapter: expected an EncoderAdapter (see encgraph.models.protocol), got {describe(adapter)}; "
                f"missing: {missing}. For a Hugging Face tower use encgraph.models.wrap(module)."
            )
        config = adapter.config
        if not isinstance(config, AdapterConfig):
            raise ConfigTypeError(f"adapter.config: expected an AdapterConfig, got {describe(config)}.")
        self.adapter = adapter
        self.config = config
        self.device = _resolve_device(device, config.device)
        if mode is None:
            mode = RunMode.GRAPH if self.device.type == "cuda" else RunMode.STATIC
        if not isinstance(mode, RunMode):
            raise ConfigTypeError(f"mode: expected an encgraph RunMode, got {describe(mode)}.")
        if mode is RunMode.GRAPH and self.device.type != "cuda":
            raise ConfigError(
                f"mode: GRAPH needs a CUDA device, the tower is on {self.device}; use RunMode.STATIC on the CPU."
            )
        self.mode = mode
        self.lazy = _check_bool("lazy", lazy)
        self.copy_outputs = _check_bool("copy_outputs", copy_outputs)
        self.warmup = check_int("warmup", warmup, minimum=1)
        self.progress = sys.stderr.isatty() if progress is None else _check_bool("progress", progress)
        self.compile = _check_bool("compile", compile)
        if isinstance(costs, (str, os.PathLike)):
            costs = CostModel.load(costs)
        if costs is not None and not isinstance(costs, CostModel):
            raise ConfigTypeError(f"costs: expected a CostModel or the path of a saved one, got {describe(costs)}.")
        self.costs: CostModel | None = costs
        self.observed: collections.deque[tuple[ItemSpec, ...]] = collections.deque(
            maxlen=check_int("record", record, minimum=0) or None
        )
        self._record = record > 0
        if self.compile and mode is not RunMode.GRAPH:
            raise ConfigError(f"compile: only the GRAPH mode compiles its static forwards, the mode is {mode.name}.")

        self.ladders = self._resolve_ladders(budgets)
        self.limits = self._resolve_limits(max_items, max_frames)
        self.records: dict[str, dict[int, GraphRecord]] = {p: {} for p in config.path_names}
        self.failed: dict[str, dict[int, str]] = {p: {} for p in config.path_names}
        self.buffers: dict[str, PathBuffers] = {}
        self.captured = False
        self.capture_info: dict[str, Any] = {}
        self._stats = RunStats(config.path_names)
        self._lock = threading.RLock()
        self._pool: Any = None
        self._dp: Any = None
        if process_group is not None:
            from encgraph.capture.distributed import DataParallelEncoder

            self._dp = DataParallelEncoder(
                self._call_local, process_group, adapter=adapter, device=self.device,
                local_stats=lambda: self._stats.as_dict(),
            )

    # ------------------------------------------------------------------ configuration
    def _resolve_ladders(self, budgets: Any) -> dict[str, tuple[int, ...]]:
        paths = self.config.paths
        if budgets is None:
            return {p.name: budget_ladder(p.min_budget, p.max_budget, allow_zero=p.allow_empty) for p in paths}
        if not isinstance(budgets, Mapping) and len(paths) > 1:
            raise ConfigError(
                f"budgets: this adapter has paths {list(self.config.path_names)}; give {{path: ladder}}, got "
                f"{describe(budgets)}."
            )
        if not isinstance(budgets, Mapping):
            budgets = {paths[0].name: budgets}
        ladders = normalize_ladders(budgets, paths=self.config.path_names)
        for p in paths:
            if 0 in ladders[p.name] and not p.allow_empty:
                raise ConfigError(f"budgets[{p.name!r}]: 0 is allowed only on a path that may be empty; drop it.")
            if p.allow_empty and 0 not in ladders[p.name]:
                ladders[p.name] = (0, *ladders[p.name])
        return ladders

    def _resolve_limits(self, max_items: int | None, max_frames: int | None) -> Limits:
        config = self.config
        if not all(p.unit is BudgetUnit.ITEMS for p in config.paths):
            return default_limits(
                self.ladders, max_frames_per_item=config.max_frames_per_item, max_items=max_items, max_frames=max_frames
            )
        # Budgets count items: every item fills one unit, so the cap on items is the largest batch size, and the
        # token rule of default_limits (items <= smallest budget) does not apply.
        largest = min(max(self.ladders[p.name]) for p in config.paths)
        items = largest if max_items is None else check_int("max_items", max_items, minimum=1)
        if items > largest:
            raise ConfigError(f"max_items: expected at most {largest} (the largest batch size captured), got {items}.")
        frames = items * config.max_frames_per_item if max_frames is None else check_int("max_frames", max_frames, minimum=1)
        return Limits(max_items=items, max_frames=frames)

    @property
    def planning_ladders(self) -> dict[str, tuple[int, ...]]:
        """The ladders ``pack`` uses: the configured ones less budgets whose capture failed (a path whose every
        capture failed keeps its ladder, and each of its batches then runs eagerly)."""
        out = {}
        for path, ladder in self.ladders.items():
            kept = tuple(b for b in ladder if b not in self.failed[path])
            out[path] = kept if any(kept) else ladder
        return out

    def plan(self, inputs: Any) -> Plan:
        """The plan a call with ``inputs`` would run (no device work beyond the adapter's validation)."""
        return self._pack(self._specs(inputs))

    def _specs(self, inputs: Any) -> list[ItemSpec]:
        specs = self.adapter.item_specs(inputs)
        if not specs:
            raise InputError("inputs: expected at least one item, got an empty batch.")
        return specs

    def _pack(self, specs: Sequence[ItemSpec]) -> Plan:
        return pack(
            specs, self.planning_ladders, max_items=self.limits.max_items, max_frames=self.limits.max_frames,
            costs=self.costs,
        )

    # ------------------------------------------------------------------ buffers and capture
    def _allocate(self) -> None:
        if self.buffers:
            return
        lim = self.limits
        for path, ladder in self.ladders.items():
            specs = {
                b: self.adapter.buffer_specs(path, b, lim.max_items, lim.max_frames) for b in ladder if b > 0
            }
            self.buffers[path] = PathBuffers(path, specs, self.device)

    def capture(self) -> dict[str, Any]:
        """Capture every budget of every path (GRAPH mode); in other modes only allocate the buffers.

        Returns (and keeps in ``capture_info``) a summary: graphs, seconds, pool bytes, failures, per graph.
        """
        with self._lock:
            if self.captured:
                return self.capture_info
            self._allocate()
            if self.mode is not RunMode.GRAPH:
                self.captured = True
                self.capture_info = {"graphs": 0, "seconds": 0.0, "mode": self.mode.value}
                return self.capture_info
            self.capture_info = self._capture_all()
            self.captured = True
            return self.capture_info

    def _capture_all(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        device = self.device
        todo = sorted(
            ((path, b) for path, ladder in self.ladders.items() for b in ladder if b > 0),
            key=lambda pb: (-pb[1], pb[0]),
        )
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        reserved0 = torch.cuda.memory_reserved(device)
        stream = torch.cuda.Stream(device)
        self._pool = torch.cuda.graph_pool_handle()
        bar = tqdm(todo, desc="encgraph: capture", unit="graph", disable=not self.progress, leave=False)
        for path, budget in bar:
            bar.set_postfix_str(f"{path}@{budget}")
            try:
                record = self._capture_one(path, budget, stream)
            except EncgraphError:
                raise
            except Exception as exc:  # OOM or a kernel that cannot be captured: drop this budget only
                torch.cuda.synchronize(device)
                self.failed[path][budget] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                log.warning(
                    "encgraph: capture of path %r at budget %d failed (%s); batches planned there move to the "
                    "next budget, or run eagerly.", path, budget, self.failed[path][budget]
                )
                continue
            self.records[path][budget] = record
        bar.close()
        torch.cuda.synchronize(device)
        for path_records in self.records.values():
            for record in path_records.values():
                record.replay_ms = self._time_replay(record)
        seconds = time.perf_counter() - start
        pool_bytes = _pool_bytes(device, self._pool)
        graphs = [r for rs in self.records.values() for r in rs.values()]
        info = {
            "mode": self.mode.value,
            "graphs": len(graphs),
            "seconds": round(seconds, 3),
            "compile_seconds": round(sum(r.compile_seconds for r in graphs), 3),
            "pool_bytes": int(pool_bytes),
            # Memory the warm-up runs left cached outside the pool (freed by torch.cuda.empty_cache()).
            "other_reserved_bytes": int(torch.cuda.memory_reserved(device) - reserved0 - pool_bytes),
            "largest_graph_bytes": max((r.memory_bytes for r in graphs), default=0),
            "buffer_bytes": sum(b.nbytes for b in self.buffers.values()),
            "failed": {p: dict(f) for p, f in self.failed.items() if f},
            "per_graph": [r.summary() for r in sorted(graphs, key=lambda r: (r.path, r.budget))],
        }
        log.info(
            "encgraph: captured %d graphs in %.2f s; pool %.1f MiB, static buffers %.1f MiB%s",
            info["graphs"], seconds, pool_bytes / 2**20, info["buffer_bytes"] / 2**20,
            f"; {sum(len(f) for f in self.failed.values())} failed" if info["failed"] else "",
        )
        return info

    def _static_forward(self, path: str, budget: int) -> Any:
        """The callable a budget's graph captures: the adapter's static forward, compiled when asked."""

        def forward(buffers: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
            return self.adapter.forward_static(path, buffers, budget)

        if not self.compile:
            return forward
        return torch.compile(forward, dynamic=False)

    def _capture_one(self, path: str, budget: int, stream: torch.cuda.Stream) -> GraphRecord:
        device = self.device
        t0 = time.perf_counter()
        views = self.buffers[path].fill(budget, None)
        forward = self._static_forward(path, budget)
        compile_seconds = 0.0
        stream.wait_stream(torch.cuda.current_stream(device))
        # Every budget is one more compiled variant of the same closure: let dynamo keep them all, only for as
        # long as this capture runs (after it, replays never enter dynamo).
        with torch.cuda.stream(stream), _dynamo_cache_limit(self.compile, 8 + sum(len(l) for l in self.ladders.values())):
            for i in range(self.warmup):
                t_run = time.perf_counter()
                self._check_outputs(path, budget, forward(views), budget, "static")
                if i == 0 and self.compile:
                    torch.cuda.synchronize(device)
                    compile_seconds = time.perf_counter() - t_run
            torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
            before = _pool_bytes(device, self._pool)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                outputs = dict(forward(views))
        torch.cuda.synchronize(device)
        self._check_outputs(path, budget, outputs, budget, "static")
        return GraphRecord(
            path=path,
            budget=budget,
            graph=graph,
            inputs=views,
            outputs=outputs,
            capture_seconds=time.perf_counter() - t0,
            memory_bytes=_pool_bytes(device, self._pool) - before,
            compile_seconds=compile_seconds,
        )

    def _time_replay(self, record: GraphRecord, repeats: int = 5) -> float:
        # Time on random floats: zeros can run faster than real data.
        self.buffers[record.path].fill(record.budget, None)
        for t in record.inputs.values():
            if t.is_floating_point():
                t.normal_()
        return self._time_host(record.graph.replay, repeats)

    # ------------------------------------------------------------------ running
    def __call__(self, inputs: Any) -> list[Any]:
        """Encode ``inputs``; return one result per item, in the caller's order (see the adapter for types).

        Results are fresh tensors unless ``copy_outputs=False`` (then views valid until the next call). With a
        ``process_group``, this rank encodes its share and every rank returns every item.
        """
        if self._dp is not None:
            return self._dp(inputs)
        return self._call_local(inputs)

    def global_stats(self) -> dict[str, Any]:
        """With a ``process_group``: the counters summed over ranks (a collective: call it on every rank)."""
        if self._dp is None:
            return self.stats
        return self._dp.global_stats()

    def _call_local(self, inputs: Any) -> list[Any]:
        with self._lock:
            specs = self._specs(inputs)
            if not self.captured:
                if self.mode is RunMode.GRAPH and not self.lazy:
                    raise CaptureError("runner: call capture() before the first call, or pass lazy=True.")
                self.capture()
            if self._record:
                self.observed.append(tuple(specs))
            plan = self._pack(specs)
            batch_results = [self._run_batch(inputs, specs, batch) for batch in plan.batches]
            self._stats.add_call()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("encgraph: call of %d items, %d batches; stats %s", len(specs), len(plan.batches), self.stats)
            return plan.restore(batch_results)

    def _run_batch(self, inputs: Any, specs: Sequence[Any], batch: Any) -> list[Any]:
        sub = self.adapter.select(inputs, batch.items)
        sub_specs = [specs[i] for i in batch.items]
        outputs: dict[str, Mapping[str, torch.Tensor]] = {}
        eager_paths: dict[str, str] = {}
        for path in self.config.path_names:
            budget = batch.budgets[path]
            used = batch.tokens[path]
            if budget == 0 or used == 0:
                continue
            reason = None
            if self.mode is RunMode.EAGER:
                reason = EAGER_MODE
            elif budget is None:
                reason = batch.eager[path].value
            elif self.mode is RunMode.GRAPH and budget not in self.records[path]:
                reason = CAPTURE_FAILED
            if reason is not None:
                out = self.adapter.forward_eager(path, sub)
                self._check_outputs(path, budget, out, used, "eager")
                eager_paths[path] = reason
                self._stats.add_eager(path, reason, sum(1 for s in sub_specs if s.tokens[path]), used)
            else:
                out = self._run_static(path, budget, sub, used)
                self._stats.add_replay(path, budget, used)
            outputs[path] = out
        self._stats.add_items(eager=sum(1 for s in sub_specs if any(s.tokens[p] for p in eager_paths)),
                              total=len(sub_specs))
        return self._split(outputs, sub_specs)

    def _run_static(self, path: str, budget: int, sub: Any, used: int) -> Mapping[str, torch.Tensor]:
        values = self.adapter.replay_values(path, sub, budget)
        views = self.buffers[path].fill(budget, values)
        if self.mode is RunMode.GRAPH:
            record = self.records[path][budget]
            record.graph.replay()
            outputs = record.outputs
            if self.copy_outputs:
                return {name: t[:used].clone() for name, t in outputs.items()}
            return {name: t[:used] for name, t in outputs.items()}
        outputs = self.adapter.forward_static(path, views, budget)
        self._check_outputs(path, budget, outputs, budget, "static")
        return {name: t[:used] for name, t in outputs.items()}

    def _split(self, outputs: Mapping[str, Mapping[str, torch.Tensor]], specs: Sequence[Any]) -> list[Any]:
        offsets = dict.fromkeys(outputs, 0)
        results = []
        for spec in specs:
            parts: dict[str, dict[str, torch.Tensor]] = {}
            for path, named in outputs.items():
                n = spec.tokens[path]
                if n:
                    o = offsets[path]
                    parts[path] = {name: t[o : o + n] for name, t in named.items()}
                    offsets[path] = o + n
            results.append(self.adapter.assemble(parts))
        return results

    def _check_outputs(self, path: str, budget: int | None, outputs: Any, rows: int, kind: str) -> None:
        # Read the adapter's config afresh: a generic adapter learns its output names on its first call.
        expected = self.adapter.config.path(path).outputs
        if not isinstance(outputs, Mapping) or tuple(sorted(outputs)) != tuple(sorted(expected)):
            raise ConfigError(
                f"forward_{kind}({path!r}): expected a mapping with outputs {list(expected)}, got "
                f"{describe(outputs) if not isinstance(outputs, Mapping) else sorted(outputs)}."
            )
        for name, t in outputs.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != rows:
                raise ConfigError(
                    f"forward_{kind}({path!r}) at budget {budget}: output {name!r} must have {rows} rows in dim 0, "
                    f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else describe(t)}."
                )

    # ------------------------------------------------------------------ costs and tuning
    def measure_costs(self, samples: Sequence[Any], *, repeats: int = 3) -> CostModel:
        """Measure a :class:`~encgraph.packing.CostModel` and plan with it from now on.

        Graph costs: each captured budget's replay time (GRAPH mode, timed at capture), or the static forward's
        time on padding (other modes). Eager costs: the adapter's eager forward timed on each sample input
        (``samples``: inputs as for a call, of varied sizes; at least two per path), fitted as fixed + per token
        + per item. Keep it with ``runner.costs.save(path)``; pass it back as ``costs=path``.
        """
        with self._lock:
            self.capture()
            graph_ms: dict[str, dict[int, float]] = {}
            for path, ladder in self.ladders.items():
                graph_ms[path] = {}
                for budget in (b for b in ladder if b > 0):
                    record = self.records[path].get(budget)
                    if record is not None and record.replay_ms is not None:
                        graph_ms[path][budget] = record.replay_ms
                    elif self.mode is not RunMode.GRAPH:
                        views = self.buffers[path].fill(budget, None)
                        graph_ms[path][budget] = self._time_host(
                            lambda: self.adapter.forward_static(path, views, budget), repeats
                        )
            eager: dict[str, list[tuple[int, int, float]]] = {p: [] for p in self.ladders}
            for inputs in samples:
                specs = self.adapter.item_specs(inputs)
                for path in self.ladders:
                    tokens = sum(s.tokens[path] for s in specs)
                    if tokens:
                        ms = self._time_host(lambda: self.adapter.forward_eager(path, inputs), repeats)
                        eager[path].append((tokens, sum(1 for s in specs if s.tokens[path]), ms))
            self.costs = CostModel.from_measurements(graph_ms, eager)
            return self.costs

    def _time_host(self, fn: Any, repeats: int) -> float:
        """Median ms of ``fn`` as the host sees it (device synchronised before and after): graph replays and
        eager forwards are measured alike, so the cost model compares like with like."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        with torch.inference_mode():
            fn()
            times = []
            for _ in range(repeats):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
        return float(statistics.median(times))

    def tune(self, *, max_budgets: int, memory_cap_tokens: int | None = None, granularity: int = 64) -> TunedLadder:
        """The ladder that minimises expected cost on the calls recorded so far (``record=N``), under the
        runner's cost model (or the planner's default one). Apply it with ``recapture(**tuned.to_runner_options())``."""
        if not self.observed:
            raise ConfigError("tune: no calls recorded; construct the runner with record=N and serve traffic first.")
        return tune_ladder(
            list(self.observed), max_budgets=max_budgets, max_items=self.limits.max_items,
            memory_cap_tokens=memory_cap_tokens, costs=self.costs, granularity=granularity, baseline=self.ladders,
        )

    def recapture(self, *, budgets: Any, max_items: int | None = None, max_frames: int | None = None) -> dict[str, Any]:
        """Drop every graph and buffer, take the new ladders and limits, and capture again (GRAPH mode).

        A measured cost model is dropped too (its budgets are gone): measure again for the new ladder.
        """
        with self._lock:
            ladders = self._resolve_ladders(budgets)
            old = (self.ladders, self.limits)
            self.ladders = ladders
            try:
                self.limits = self._resolve_limits(max_items, max_frames)
            except EncgraphError:
                self.ladders, self.limits = old
                raise
            self.records = {p: {} for p in self.config.path_names}
            self.failed = {p: {} for p in self.config.path_names}
            self.buffers = {}
            self._pool = None
            self.costs = None
            self.captured = False
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return self.capture()

    # ------------------------------------------------------------------ reporting
    @property
    def stats(self) -> dict[str, Any]:
        """Counters since construction (or ``reset_stats()``), as a plain dict:

        ``calls``, ``items``, ``graph_items`` (items whose every path ran the static forward: a replay in GRAPH
        mode), ``eager_items`` (items with at least one path run eagerly), ``eager_reasons`` (item-paths per
        reason), ``paths`` (per path: ``replays`` per budget, ``eager_runs``, ``eager_items``, ``real_tokens``,
        ``padded_tokens``), ``capture`` (the capture summary). ``graph_items + eager_items == items``.
        """
        out = self._stats.as_dict()
        if self._dp is not None:
            out["data_parallel"] = self._dp.stats
        out["mode"] = self.mode.value
        out["capture"] = dict(self.capture_info)
        return out

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = RunStats(self.config.path_names)

    def __repr__(self) -> str:
        return (
            f"EncoderGraphRunner(mode={self.mode.value}, device={self.device}, ladders={self.ladders}, "
            f"limits={self.limits}, captured={self.captured})"
        )


_ADAPTER_METHODS = (
    "config", "item_specs", "select", "buffer_specs", "replay_values", "forward_static", "forward_eager", "assemble",
)


@contextlib.contextmanager
def _dynamo_cache_limit(active: bool, limit: int) -> Iterator[None]:
    if not active:
        yield
        return
    import torch._dynamo

    with torch._dynamo.config.patch(cache_size_limit=max(limit, torch._dynamo.config.cache_size_limit)):
        yield


def _pool_bytes(device: torch.device, pool: Any) -> int:
    """Bytes of the segments the caching allocator holds for the graphs' private ``pool`` on ``device``
    (the memory the captured graphs keep; the snapshot is cheap at capture time, never on the hot path)."""
    total = 0
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device") == device.index and tuple(seg.get("segment_pool_id", ())) == tuple(pool):
            total += int(seg["total_size"])
    return total


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigTypeError(f"{name}: expected True or False, got {describe(value)}.")
    return value


def _resolve_device(device: torch.device | str | None, tower: torch.device) -> torch.device:
    if device is None:
        resolved = tower
    else:
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigTypeError(f"device: expected a torch.device or a string like 'cuda:0', got {describe(device)}.") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device: {resolved} was asked for but CUDA is not available; use device='cpu'.")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    tower_norm = tower
    if tower.type == "cuda" and tower.index is None and torch.cuda.is_available():
        tower_norm = torch.device("cuda", torch.cuda.current_device())
    if resolved != tower_norm:
        raise ConfigError(
            f"device: the tower's weights are on {tower}, but device={resolved} was asked for; move the module "
            f"first (module.to({str(resolved)!r})) or leave device unset."
        )
    return resolved
