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
import os
import logging
import statistics
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from encgraph._validate import check_int, describe
from encgraph.capture.buffers import PathBuffers, PathOutputs
from encgraph.capture.compiling import CompileMode, resolve_compile
from encgraph.capture.grad import persistent
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
    default_limits,
    dense_ladder,
    normalize_ladders,
    pack,
    tune_ladder,
)

__all__ = ["EncoderGraphRunner", "CAPTURE_FAILED", "EAGER_MODE"]

log = logging.getLogger("encgraph")

CAPTURE_FAILED = "capture failed at that budget"
TOKEN_RATIO = 1.2
"""Default ladder spacing of token paths: a single item pads by at most ~20%, ~9% on average (log-uniform
sizes), which the cost-aware planner then trims further by packing items together."""
ITEM_RATIO = 1.25
"""Default ladder spacing of item paths (batch sizes 1, 2, 3, 4, 5, 6, 8, 10, ...)."""
EAGER_MODE = "runner in eager mode"


class EncoderGraphRunner:
    """Capture an adapter's static-shape forward once per budget and replay it for batches of any size.

    Args:
        adapter: an :class:`~encgraph.capture.protocol.EncoderAdapter` (see ``encgraph.models.wrap``).
        budgets: the ladder of one path (an iterable of ints) or ``{path: ladder}``; default: per path,
            ``dense_ladder(min_budget, max_budget, allow_zero=allow_empty)`` from the adapter (neighbours about
            1.2x apart above a few multiples of the smallest, so a single item pads by at most ~20%).
        max_items, max_frames: per-batch limits; defaults from :func:`encgraph.packing.default_limits`.
        device: must be where the adapter's tower lives; default the adapter's device.
        mode: :class:`RunMode`; default ``GRAPH`` on CUDA, ``STATIC`` on CPU.
        lazy: capture on the first call if ``capture()`` was not called (else that call raises).
        copy_outputs: results are fresh tensors (default). ``False``: zero-copy, results are views of the
            graphs' output buffers, **valid only until the next call** of this runner.
        warmup: eager runs of each budget's static forward on the side stream before its capture.
        progress: show a progress bar while capturing; default when stderr is a terminal.
        compile: ``"auto"`` (default): in GRAPH mode, compile before capturing, with a symbolic token
            dimension so that one compilation serves every budget: the tower's repeated blocks where the adapter
            names them (``compile_regions()``; compiled only while capturing), else the whole static forward of
            each path (:mod:`encgraph.capture.compiling`). If compiling fails, log it once, capture the plain
            forward and record why in ``capture_info["compile"]``. ``True``: compile, failures are errors.
            ``False``: never compile. Outside GRAPH mode nothing is compiled.
        cache_dir: where torch's compile caches persist across processes (default
            :func:`encgraph.capture.compiling.default_cache_dir`; a user's ``TORCHINDUCTOR_CACHE_DIR`` wins).
        costs: ``None`` (default): in GRAPH mode, ``capture()`` measures a :class:`~encgraph.packing.CostModel`
            (replay times and eager timings on the adapter's ``sample_inputs``) and every call is planned by the
            cost-aware packer (batch splits and graph-vs-eager of least expected time); other modes plan
            greedily. ``False``: the greedy planner always. A ``CostModel`` (or the path of one saved as JSON):
            plan with it. ``measure_costs(samples)`` measures one on real inputs.
        verify: at capture, run each budget's padded static forward and the eager forward on the same sample
            items and drop a budget that disagrees (logged; its batches run eagerly). Default on.
        record: keep the item specs of the last ``record`` calls (``observed``), for ``tune()``.
        process_group: a ``torch.distributed`` group (``torch.distributed.group.WORLD`` for all ranks): spread
            each call's items over its ranks (balanced by size), every rank returns every item in the caller's
            order (:class:`~encgraph.capture.distributed.DataParallelEncoder`). Every rank must get the same
            inputs and call ``capture()`` before its first call; ``global_stats()`` counts each item once.

    Grad modes: calls work under ``torch.inference_mode()``, ``torch.no_grad()`` or neither, in any order; results
    never carry autograd history (``encgraph.graphed`` runs the module's own forward when autograd is asked for).

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
        compile: bool | str | CompileMode = "auto",
        cache_dir: str | os.PathLike[str] | None = None,
        costs: CostModel | str | os.PathLike[str] | bool | None = None,
        verify: bool = True,
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
        self.compile_mode = resolve_compile(compile, graph_mode=mode is RunMode.GRAPH)
        self.cache_dir = cache_dir
        self.verify = _check_bool("verify", verify)
        if isinstance(costs, (str, os.PathLike)):
            costs = CostModel.load(costs)
        if costs is not None and not isinstance(costs, (CostModel, bool)):
            raise ConfigTypeError(
                f"costs: expected None (measured at capture), False (greedy), a CostModel or the path of a saved "
                f"one, got {describe(costs)}."
            )
        if costs is True:
            raise ConfigTypeError("costs: expected None (measured at capture), False (greedy) or a CostModel, got True.")
        # None: measured at capture in GRAPH mode (the default); False: greedy; a model: given.
        self._measure_costs = costs is None and mode is RunMode.GRAPH
        self.costs: CostModel | None = costs if isinstance(costs, CostModel) else None
        self.kernels: dict[str, Any] = {}  # attention-kernel crossovers chosen at capture (capture/kernels.py)
        self.observed: collections.deque[tuple[ItemSpec, ...]] = collections.deque(
            maxlen=check_int("record", record, minimum=0) or None
        )
        self._record = record > 0

        self.ladders = self._resolve_ladders(budgets)
        self.limits = self._resolve_limits(max_items, max_frames)
        self.records: dict[str, dict[int, GraphRecord]] = {p: {} for p in config.path_names}
        self.failed: dict[str, dict[int, str]] = {p: {} for p in config.path_names}
        self.buffers: dict[str, PathBuffers] = {}
        self.outputs: dict[str, PathOutputs] = {p: PathOutputs(p, self.device) for p in config.path_names}
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
            return {
                p.name: dense_ladder(
                    p.min_budget, p.max_budget, allow_zero=p.allow_empty,
                    ratio=ITEM_RATIO if p.unit is BudgetUnit.ITEMS else TOKEN_RATIO,
                )
                for p in paths
            }
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
        """Capture every budget of every path (GRAPH mode; other modes only allocate the buffers), then run the
        self-check and measure the default cost model on the adapter's sample inputs
        (:mod:`encgraph.capture.selfcheck`).

        Returns (and keeps in ``capture_info``) a summary: graphs, seconds, pool bytes, compile status,
        failures (with the self-check's reasons), per graph, and ``selfcheck``.
        """
        with self._lock, persistent():
            if self.captured:
                return self.capture_info
            t0 = time.perf_counter()
            self._allocate()
            if self.mode is RunMode.GRAPH:
                from encgraph.capture.capture import capture_graphs

                info = capture_graphs(self)
            else:
                info = {"graphs": 0, "mode": self.mode.value, "compile": {"mode": self.compile_mode.value}}
            self.captured = True
            from encgraph.capture.kernels import choose_kernels, keep_kernels
            from encgraph.capture.selfcheck import check_and_measure

            try:
                info["kernels"] = choose_kernels(self)  # first: the eager timings below run the chosen kernels
                info["selfcheck"] = check_and_measure(self, verify=self.verify, measure=self._measure_costs)
            except BaseException:
                self.captured = False
                raise
            keep_kernels(self)
            info["failed"] = {p: dict(f) for p, f in self.failed.items() if f}
            info["costs"] = "cost-aware (measured at capture)" if self._measure_costs and self.costs is not None else (
                "cost-aware (given)" if self.costs is not None else "greedy"
            )
            info["seconds"] = round(time.perf_counter() - t0, 3)
            self.capture_info = info
            return info

    def prepare(self, inputs: Any) -> None:
        """Validate ``inputs`` and capture if that has not happened (as the first call would, ``lazy`` allowing):
        an adapter that learns its shapes from a call (the generic one) can then be captured and self-checked
        before that call is planned."""
        with self._lock:
            self._specs(inputs)
            if not self.captured and (self.lazy or self.mode is not RunMode.GRAPH):
                self.capture()

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
        with self._lock, torch.no_grad():
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
            outputs = record.outputs  # views of the path's shared output buffers
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
            for sample in samples:
                specs = self._specs(sample)
                # select() gives the adapter's own inputs type, whatever form a call accepted (a raw tuple too).
                inputs = self.adapter.select(sample, list(range(len(specs))))
                for path in self.ladders:
                    tokens = sum(s.tokens[path] for s in specs)
                    if tokens:
                        ms = self._time_host(lambda: self.adapter.forward_eager(path, inputs), repeats)
                        eager[path].append((tokens, sum(1 for s in specs if s.tokens[path]), ms))
            from encgraph.capture.kernels import keep_kernels

            self.costs = CostModel.from_measurements(graph_ms, eager)
            self._measure_costs = False
            keep_kernels(self)
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
            self.outputs = {p: PathOutputs(p, self.device) for p in self.config.path_names}
            self._pool = None
            if self.costs is not None and not self._measure_costs:
                log.info("encgraph: recapture drops the cost model (its budgets are gone); planning greedily until "
                         "measure_costs() is called again.")
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
