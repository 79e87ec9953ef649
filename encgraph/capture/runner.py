"""The runner: plan each call, fill static buffers, replay captured graphs (or run eagerly), hand results back.

Phases, in the order a runner lives through them:

1. construction - validate the adapter and options, fix the ladders and limits (no device work);
2. ``capture()`` - allocate each path's buffers at its largest budget, warm each budget's static forward up on
   the calling stream, run the self-check's and the cost model's eager forwards, then capture every budget into one
   shared memory pool, largest first (rule 10), with nothing eager in between, time each replay and check it
   against the eager reference; a budget whose capture or check fails is logged and dropped, the rest keep
   working;
3. ``__call__`` - item specs -> ``pack`` -> per batch: select the sub-batch, fill the buffers of its budget
   (every row, by the adapter's fill rules), replay (or run eagerly where no budget fits) -> per-item results
   as fresh tensors, in the caller's order (:mod:`encgraph.capture.calls`).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from encgraph._validate import check_int, describe
from encgraph.capture import calls, relayout
from encgraph.capture.buffers import PathBuffers, PathOutputs
from encgraph.capture.capture import capture_graphs
from encgraph.capture.compiled_eager import CompiledEager
from encgraph.capture.compiling import CompileMode, resolve_compile
from encgraph.capture.execution import CAPTURE_FAILED, EAGER_MODE, item_specs
from encgraph.capture.feedback import CostFeedback, event_factory
from encgraph.capture.grad import persistent
from encgraph.capture.kernels import choose_kernels, keep_kernels
from encgraph.capture.options import check_bool, resolve_device, resolve_ladders, resolve_limits
from encgraph.capture.protocol import AdapterConfig, EncoderAdapter
from encgraph.capture.records import GraphRecord, RunMode
from encgraph.capture.selfcheck import SelfCheck, measure_cost_model
from encgraph.capture.stats import RunStats
from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing import CostModel, ItemSpec, Plan, TunedLadder, pack

__all__ = ["EncoderGraphRunner", "CAPTURE_FAILED", "EAGER_MODE"]


class EncoderGraphRunner:
    """Capture an adapter's static-shape forward once per budget and replay it for batches of any size.

    Args:
        adapter: an :class:`~encgraph.capture.protocol.EncoderAdapter` (see ``encgraph.models.wrap``).
        budgets: the ladder of one path (an iterable of ints) or ``{path: ladder}``; default: per path,
            ``dense_ladder(min_budget, max_budget, allow_zero=allow_empty)`` from the adapter (neighbours about
            1.2x apart above a few multiples of the smallest, so a single item pads by at most ~20%).
        max_items, max_frames: per-batch limits; defaults from :func:`encgraph.packing.default_limits`.
        device: must be where the adapter's tower lives; default the adapter's device.
        mode: :class:`RunMode`; default ``GRAPH`` on CUDA, ``EAGER`` on the CPU (the adapter's eager forward: no
            graphs to gain, so no padding, capture or self-check to pay for; ``STATIC`` runs the padded plan).
        lazy: capture on the first call if ``capture()`` was not called (else that call raises).
        copy_outputs: results are fresh tensors (default). ``False``: zero-copy, results are views of the
            graphs' output buffers, **valid only until the next call** of this runner.
        warmup: eager runs of each budget's static forward (on the calling stream) before its capture.
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
            plan with it. ``measure_costs(samples)`` measures one on real inputs. A model in use is checked while
            serving and corrected (:mod:`encgraph.capture.feedback`; ``stats["cost_feedback"]``).
        verify: at capture (not in EAGER mode: nothing padded runs), run each budget's padded static forward and the
            eager forward on the same sample items and drop a budget that disagrees, or whose check raised (logged,
            the reason in ``capture_info["failed"]``; its batches run at the next budget or eagerly). Default on.
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
        self.device = resolve_device(device, config.device)
        if mode is None:
            # No graphs to gain on a CPU: the adapter's eager forward costs what the tower's does, at once.
            mode = RunMode.GRAPH if self.device.type == "cuda" else RunMode.EAGER
        if not isinstance(mode, RunMode):
            raise ConfigTypeError(f"mode: expected an encgraph RunMode, got {describe(mode)}.")
        if mode is RunMode.GRAPH and self.device.type != "cuda":
            raise ConfigError(
                f"mode: GRAPH needs a CUDA device, the tower is on {self.device}; use RunMode.EAGER (the CPU default) or RunMode.STATIC (the padded plan) on the CPU."
            )
        self.mode = mode
        self.lazy = check_bool("lazy", lazy)
        self.copy_outputs = check_bool("copy_outputs", copy_outputs)
        self.warmup = check_int("warmup", warmup, minimum=1)
        self.progress = sys.stderr.isatty() if progress is None else check_bool("progress", progress)
        self.compile_mode = resolve_compile(compile, graph_mode=mode is RunMode.GRAPH)
        self.cache_dir = cache_dir
        self.verify = check_bool("verify", verify)
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
        self._costs: CostModel | None = costs if isinstance(costs, CostModel) else None
        self.kernels: dict[str, Any] = {}  # attention-kernel crossovers chosen at capture (capture/kernels.py)
        # The blocks compiled for capture, reused by eager forwards once checked (capture/compiled_eager.py).
        self.compiled_eager = CompiledEager.off("not captured yet")
        self.observed: collections.deque[tuple[ItemSpec, ...]] = collections.deque(
            maxlen=check_int("record", record, minimum=0) or None
        )
        self._record = record > 0

        self.ladders = resolve_ladders(self.config, budgets)
        self.limits = resolve_limits(self.config, self.ladders, max_items, max_frames)
        self.records: dict[str, dict[int, GraphRecord]] = {p: {} for p in config.path_names}
        self.failed: dict[str, dict[int, str]] = {p: {} for p in config.path_names}
        self.buffers: dict[str, PathBuffers] = {}
        self.outputs: dict[str, PathOutputs] = {p: PathOutputs(p, self.device) for p in config.path_names}
        self.captured = False
        self.capture_info: dict[str, Any] = {}
        self._stats = RunStats(config.path_names)
        self._feedback = CostFeedback(event_factory(self.device))
        self._lock = threading.RLock()
        self._pool: Any = None
        self._dp: Any = None
        if process_group is not None:
            from encgraph.capture.distributed import DataParallelEncoder

            self._dp = DataParallelEncoder(
                self._call_local, process_group, adapter=adapter, device=self.device,
                local_stats=lambda: self._stats.as_dict(),
            )

    # ------------------------------------------------------------------ planning
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
        return self._pack(item_specs(self.adapter, inputs))

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
        """Capture every budget of every path (GRAPH mode; other modes only allocate the buffers), run the
        self-check and measure the default cost model on the adapter's sample inputs
        (:class:`~encgraph.capture.selfcheck.SelfCheck`: its eager forwards after the warm-ups and before the
        first graph, its replays after the last; :mod:`encgraph.capture.capture` says why).

        Returns (and keeps in ``capture_info``) a summary: graphs, seconds, pool bytes, compile status,
        failures (with the self-check's reasons), per graph, and ``selfcheck``.
        """
        with self._lock, persistent():
            if self.captured:
                return self.capture_info
            t0 = time.perf_counter()
            if self.mode is not RunMode.EAGER:  # eager runs read no static buffer
                self._allocate()
            # First: the graphs capture, and the eager timings below run, the kernels chosen here (a geometry's
            # varlen kernels are the process's from now on: encgraph.models.varlen_kernel.use); graphs captured
            # before the choice would keep the old kernel while the eager forwards ran the new one.
            kernels = choose_kernels(self)
            memory: dict[str, dict[str, float]] = {}
            # Nothing padded runs in EAGER mode: nothing to check. The self-check's eager half runs before the
            # first graph is captured, its replay half after (encgraph.capture.selfcheck.SelfCheck).
            check = SelfCheck(self, verify=self.verify and self.mode is not RunMode.EAGER,
                              measure=self._measure_costs, memory=memory)
            if self.mode is RunMode.GRAPH:
                self._pool = torch.cuda.graph_pool_handle()
                info = capture_graphs(self, self._pool, before_capture=check.run_eager, memory=memory)
            else:
                info = {"graphs": 0, "mode": self.mode.value, "compile": {"mode": self.compile_mode.value}}
                self.compiled_eager = CompiledEager.off(f"runner in {self.mode.value} mode: nothing is compiled")
                check.run_eager()
            info["kernels"] = kernels
            self.captured = True
            try:
                info["selfcheck"] = check.finish()
            except BaseException:
                self.captured = False
                raise
            keep_kernels(self)
            info["compile"]["eager"] = self.compiled_eager.as_dict()
            info["failed"] = {p: dict(f) for p, f in self.failed.items() if f}
            info["costs"] = "cost-aware (measured at capture)" if self._measure_costs and self.costs is not None else (
                "cost-aware (given)" if self.costs is not None else "greedy"
            )
            info["memory_peak_rise_mib"] = memory  # per phase (encgraph.capture.memory); empty off CUDA
            info["seconds"] = round(time.perf_counter() - t0, 3)
            self.capture_info = info
            return info

    def prepare(self, inputs: Any) -> None:
        """Validate ``inputs`` and capture if that has not happened (as the first call would, ``lazy`` allowing):
        an adapter that learns its shapes from a call (the generic one) can then be captured and self-checked
        before that call is planned."""
        with self._lock:
            item_specs(self.adapter, inputs)
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

    def call_rows(self, inputs: Any) -> dict[str, torch.Tensor] | None:
        """Encode ``inputs`` whose every item is one row of every output (a batch ladder's images): each output
        over the call's items in the caller's order, one tensor per output name, without the per-item results
        :meth:`__call__` cuts and the adapter joins again. ``None`` (nothing run) for a runner of several paths
        or a data-parallel one; call the runner then. Fresh tensors unless ``copy_outputs=False``."""
        if self._dp is not None:
            return None
        return calls.call_rows(self, inputs)

    def _call_local(self, inputs: Any) -> list[Any]:
        return calls.call(self, inputs)

    # ------------------------------------------------------------------ costs and tuning
    @property
    def costs(self) -> CostModel | None:
        """The cost model calls are planned with (``None``: the greedy planner). Replacing it (assigning one here;
        ``measure_costs`` and ``recapture`` do too) restarts its checking while serving: what the feedback learned
        about the old model is dropped (:meth:`~encgraph.capture.feedback.CostFeedback.reset`)."""
        return self._costs

    @costs.setter
    def costs(self, value: CostModel | None) -> None:
        if value is not None and not isinstance(value, CostModel):
            raise ConfigTypeError(f"costs: expected a CostModel or None (greedy), got {describe(value)}.")
        with self._lock:
            if value is not self._costs:
                self._feedback.reset()
            self._costs = value

    def measure_costs(self, samples: Sequence[Any], *, repeats: int = 3) -> CostModel:
        """Measure a :class:`~encgraph.packing.CostModel` and plan with it from now on.

        Graph costs: each captured budget's replay time (GRAPH mode, timed at capture), or the static forward's
        time on padding (other modes). Eager costs: the adapter's eager forward timed on each sample input
        (``samples``: inputs as for a call, of varied sizes; at least two per path), fitted as fixed + per token
        + per item. Keep it with ``runner.costs.save(path)``; pass it back as ``costs=path``.
        """
        if self.mode is RunMode.EAGER:  # the CPU default: no padded buffers to time, no plan to price
            raise ConfigError("measure_costs: expected a runner that plans (mode=RunMode.GRAPH or STATIC), got "
                              "mode=RunMode.EAGER; construct it with mode=RunMode.STATIC (or on CUDA).")
        with self._lock:
            self.capture()
            self.costs = measure_cost_model(self, samples, repeats)
            self._measure_costs = False
            keep_kernels(self)
            return self.costs

    def tune(self, *, max_budgets: int, memory_cap_tokens: int | None = None, granularity: int = 64) -> TunedLadder:
        """The ladder that minimises expected cost on the calls recorded so far (``record=N``), under the
        runner's cost model (or the planner's default one). Apply it with ``recapture(**tuned.to_runner_options())``."""
        return relayout.tune(self, max_budgets=max_budgets, memory_cap_tokens=memory_cap_tokens,
                             granularity=granularity)

    def recapture(self, *, budgets: Any, max_items: int | None = None, max_frames: int | None = None) -> dict[str, Any]:
        """Drop every graph and buffer, take the new ladders and limits, and capture again (GRAPH mode).

        A measured cost model is dropped too (its budgets are gone): measure again for the new ladder.
        """
        with self._lock:
            relayout.reset_ladders(self, budgets, max_items, max_frames)
            return self.capture()

    # ------------------------------------------------------------------ reporting
    @property
    def stats(self) -> dict[str, Any]:
        """Counters since construction (or ``reset_stats()``), as a plain dict:

        ``calls``, ``items``, ``graph_items`` (items whose every path ran the static forward: a replay in GRAPH
        mode), ``eager_items`` (items with at least one path run eagerly), ``eager_reasons`` (item-paths per
        reason), ``paths`` (per path: ``replays`` per budget, ``eager_runs``, ``eager_items``, ``real_tokens``,
        ``padded_tokens``), ``capture`` (the capture summary), ``cost_feedback`` (the cost model's checks while
        serving: ``samples`` read, ``explored`` replays, ``unchosen`` eager runs not timed (forced eager),
        ``corrections`` per kind, cumulative ``scale`` per path; kept across ``reset_stats()``),
        ``compiled_eager`` (whether eager forwards run through the blocks compiled for capture, and how often:
        :meth:`~encgraph.capture.compiled_eager.CompiledEager.as_dict`).
        ``graph_items + eager_items == items``.
        """
        out = self._stats.as_dict()
        if self._dp is not None:
            out["data_parallel"] = self._dp.stats
        out["mode"] = self.mode.value
        out["cost_feedback"] = self._feedback.as_dict()
        out["compiled_eager"] = self.compiled_eager.as_dict()
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
