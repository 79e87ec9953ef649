"""The systems compared (:class:`System`) and :class:`TowerBench`: one tower, built once, ready to run through
each of them side by side in one process.

Systems, all under ``torch.inference_mode()``:

- ``hf_sdpa``: the Hugging Face tower's own forward with ``attn_implementation="sdpa"`` (a copy of the tower that
  encgraph never touches);
- ``hf_varlen``: the same forward on the adapter's copy, switched to encgraph's packed varlen attention
  (``encgraph.models.attention.use_packed_attention``); packed (Qwen-VL) towers only;
- ``hf_compile_dynamic``: ``torch.compile(hf_tower, dynamic=True)`` on the ``hf_sdpa`` copy: what a user tries
  instead of encgraph (CUDA: inductor; the CPU smoke traces with the ``eager`` backend, in seconds);
- ``adapter_eager``: ``EncoderGraphRunner(adapter, mode=RunMode.EAGER)``: the adapter's eager forward per planned
  batch;
- ``defaults``: ``encgraph.graphed(tower)`` with no options at all, on a copy of its own, called with the tower's
  own arguments: whatever the library's defaults are when it runs (``capture()`` called first and timed); for a
  model whose features function the adapter replaces (``TowerSpec.features``: Step-3.7), that function's shim
  over ``EncoderGraphRunner(wrap(model))`` with no options (:class:`FeatureShim`);
- ``defaults_varlen``: ``defaults`` on a copy of its own, with one packed varlen kernel for every attention call,
  eager forwards' included: the adapter's kernel choice still measures the crossovers and picks the varlen kernel
  (FlashAttention-4 where installed and faster, else torch's Flash), but no eager sequence runs dense
  (:func:`pin_varlen`; graphs run varlen only in ``defaults`` too). Side by side with ``defaults``, it measures
  what eager forwards' dense SDPA per long sequence pays on a trace. Towers whose adapter chooses no kernels:
  n/a;
- ``graph``: ``EncoderGraphRunner(adapter, mode=RunMode.GRAPH)`` after ``capture()`` (``STATIC`` on the CPU);
- ``compile``: the same runner plan and buffers in ``STATIC`` mode, with the adapter's static-shape forward passed
  through ``torch.compile(mode="reduce-overhead", dynamic=False)`` (CUDA only; one compile per budget);
- ``graph_compile``: ``EncoderGraphRunner(adapter, compile=True)``: encgraph's graphs of the compiled static
  forward, captured at ``TowerBench.compile_budgets`` (default: the ``graph`` runner's ladder).
"""

from __future__ import annotations

import argparse
import copy
import enum
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

from benches.lib.cases import BenchInputs, Visual, make_inputs
from benches.lib.compiled import CompiledStatic, compile_dynamic
from benches.lib.env import Env, free_memory, short_error
from benches.lib.results import json_ready
from benches.lib.towers import Geometry, TowerKind, TowerSpec, build_tower


class System(enum.Enum):
    """A way to run a tower's forward, compared side by side."""

    HF_SDPA = "hf_sdpa"
    HF_VARLEN = "hf_varlen"
    HF_COMPILE_DYNAMIC = "hf_compile_dynamic"
    ADAPTER_EAGER = "adapter_eager"
    DEFAULTS = "defaults"
    DEFAULTS_VARLEN = "defaults_varlen"
    GRAPH = "graph"
    COMPILE = "compile"
    GRAPH_COMPILE = "graph_compile"

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {
    System.HF_SDPA: "HF eager (sdpa)",
    System.HF_VARLEN: "HF eager (encgraph varlen)",
    System.HF_COMPILE_DYNAMIC: "HF + torch.compile(dynamic=True)",
    System.ADAPTER_EAGER: "adapter eager",
    System.DEFAULTS: "encgraph defaults (graphed(tower))",
    System.DEFAULTS_VARLEN: "encgraph defaults, varlen kernel only",
    System.GRAPH: "encgraph graphs",
    System.COMPILE: "torch.compile reduce-overhead",
    System.GRAPH_COMPILE: "encgraph graphs of compiled forward",
}
COMPILED = (System.COMPILE, System.GRAPH_COMPILE)
"""Systems that compile per budget (tens of seconds each) into CUDA graphs: CUDA only, on chosen cases."""
RUNNER_SYSTEMS = (System.ADAPTER_EAGER, System.GRAPH, *COMPILED)
"""Systems that call an ``EncoderGraphRunner`` over the benchmark's own adapter."""
GRAPHED_SYSTEMS = (System.DEFAULTS, System.DEFAULTS_VARLEN)
"""Systems that are ``encgraph.graphed(tower)`` on a copy of their own (captured, and timed, on first use)."""
GRAPH_SYSTEMS = (*GRAPHED_SYSTEMS, System.GRAPH, System.GRAPH_COMPILE)
"""Systems that replay captured graphs (their padded share and eager items are reported)."""
_COPIES: dict[str, tuple[System, ...]] = {
    "hf": (System.HF_SDPA, System.HF_COMPILE_DYNAMIC),
    "enc": (System.HF_VARLEN, *RUNNER_SYSTEMS),
    "defaults": (System.DEFAULTS,),
    "defaults_varlen": (System.DEFAULTS_VARLEN,),
}
"""Which copy of the tower each system runs on: ``hf`` is never wrapped, ``enc`` carries the benchmark's adapter,
``defaults`` is wrapped by ``graphed()`` alone (a wrapped tower must not be copied, so copies come first)."""


class FeatureShim:
    """``graphed()``'s stand-in for a model whose adapter replaces a features function rather than a forward
    (Step-3.7's ``get_image_features``): the adapter's ``shim`` over ``EncoderGraphRunner(wrap(model),
    **runner_options)``, with the members of :class:`~encgraph.models.graphed_forward.GraphedForward` the benchmarks read (``capture()``,
    ``stats``, ``runner``, ``inner``)."""

    def __init__(self, model: Any, **runner_options: Any) -> None:
        from encgraph.capture import EncoderGraphRunner
        from encgraph.models import wrap

        self.inner = model
        self.adapter = wrap(model)
        self.runner = EncoderGraphRunner(self.adapter, **runner_options)
        self._features = self.adapter.shim(self.runner)

    def capture(self) -> dict[str, Any]:
        return self.runner.capture()

    @property
    def stats(self) -> dict[str, Any]:
        return self.runner.stats

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._features(*args, **kwargs)


def parse_systems(text: str) -> tuple[System, ...]:
    """``"graph,adapter_eager"`` -> systems, in that order (argparse ``type``)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    known = {s.value: s for s in System}
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of {sorted(known)}, got {text!r}")
    return tuple(known[n] for n in names)


class TowerBench:
    """One tower and everything a script runs it through.

    The tower is built once (random weights, seeded) and copied for each group of systems that needs its own
    module (``_COPIES``). Runners, the graphed module and the compiled module are made on first use; capture
    summaries land in ``capture_infos`` (``wall_seconds`` included). Where an adapter is missing
    (``encgraph.models.wrap`` or ``graphed`` raised) those systems report ``unavailable``.
    """

    defaults_options: ClassVar[Mapping[str, Any]] = {}
    """Runner options of ``defaults`` when the constructor is given none: none, the library's defaults. Only the
    CPU tests set one (``verify=False``: skipping the capture's self-check spares them seconds per tower)."""

    def __init__(self, spec: TowerSpec, env: Env, systems: Iterable[System],
                 defaults_options: Mapping[str, Any] | None = None) -> None:
        self.spec = spec
        self.env = env
        self.graphed_options: dict[str, Any] = dict(
            type(self).defaults_options if defaults_options is None else defaults_options)
        """Runner options ``defaults`` is built with: :attr:`defaults_options` unless given (an A/B run of one
        option, labelled so in its results)."""
        self.systems = tuple(systems)
        t0 = time.perf_counter()
        tower = build_tower(spec, env)
        self.params = sum(p.numel() for p in tower.parameters())
        self.geom = Geometry.of(spec.kind, tower.config, spec.facts)
        groups = [g for g, members in _COPIES.items() if any(s in members for s in self.systems)]
        modules = {g: tower if i == len(groups) - 1 else copy.deepcopy(tower) for i, g in enumerate(groups)}
        del tower
        self.hf: Any = modules.get("hf")
        self.enc: Any = modules.get("enc")
        self._graphed_towers: dict[System, Any] = {
            System.DEFAULTS: modules.get("defaults"), System.DEFAULTS_VARLEN: modules.get("defaults_varlen")}
        self.adapter: Any = None
        self._graphed: dict[System, Any] = {}
        self._handles: dict[System, Any] = {}  # what captures and counts: encgraph.graphs(graphed), or the FeatureShim
        self.unavailable: dict[System, str] = {}
        self.attention_switch: Any = None
        self.compile_backend = "inductor" if env.cuda else "eager"
        """``hf_compile_dynamic``'s backend: inductor on CUDA; the CPU smoke traces with dynamo alone."""
        self._wrap()
        for system in COMPILED:
            if system in self.systems and not env.cuda:
                self.unavailable[system] = "skipped: needs CUDA (torch.compile into CUDA graphs)"
        self.build_seconds = time.perf_counter() - t0
        self._runners: dict[System, Any] = {}
        self._compiled_hf: Any = None
        self.capture_infos: dict[System, dict[str, Any]] = {}
        self.graph_budgets: dict[str, tuple[int, ...]] | None = None
        """Ladders of the ``graph`` runner (default: the adapter's)."""
        self.compile_budgets: dict[str, tuple[int, ...]] | None = None
        """Ladders of the ``graph_compile`` runner (default: the ``graph`` runner's)."""

    def _wrap(self) -> None:
        if self.enc is not None:
            try:
                from encgraph.models import wrap

                self.adapter = wrap(self.enc)
            except Exception as exc:  # the adapter of this family may not exist yet: measure the rest
                for s in RUNNER_SYSTEMS:
                    self.unavailable[s] = f"unavailable: no adapter ({short_error(exc)})"
            if self.spec.kind is TowerKind.FIXED:
                self.unavailable[System.HF_VARLEN] = "n/a: a fixed-size tower has no packed sequences"
            elif self.spec.kind is not TowerKind.PACKED:
                self.unavailable[System.HF_VARLEN] = "n/a: encgraph's varlen switch is for Qwen-VL layout towers"
            elif System.HF_VARLEN in self.systems:
                try:
                    from encgraph.models.attention import use_packed_attention

                    self.attention_switch = use_packed_attention(self.enc)
                except Exception as exc:
                    self.unavailable[System.HF_VARLEN] = f"unavailable: {short_error(exc)}"
        for system, tower in self._graphed_towers.items():
            if tower is not None:
                self._wrap_graphed(system, tower)
        if self.spec.features:
            self.unavailable[System.HF_COMPILE_DYNAMIC] = (
                f"n/a: the benchmark calls {self.spec.features}, not a forward to compile")

    def _wrap_graphed(self, system: System, tower: Any) -> None:
        """``graphed(tower)`` (or the features shim) for ``system``; ``defaults_varlen`` pinned to one varlen
        kernel."""
        try:
            import encgraph

            if self.spec.features:
                if system is System.DEFAULTS_VARLEN:
                    self.unavailable[system] = "n/a: the adapter's features shim is measured as defaults only"
                    return
                self._graphed[system] = self._handles[system] = FeatureShim(tower, **self.graphed_options)
            else:  # no options: the library's defaults; graphed() hooks the tower itself
                self._graphed[system] = encgraph.graphed(tower, **self.graphed_options)
                self._handles[system] = encgraph.graphs(self._graphed[system])
            if system is System.DEFAULTS_VARLEN:
                handle = self._handles[system]
                why = (pin_varlen(handle.runner.adapter) if handle.family else
                       "n/a: the any-module path chooses no attention kernels")
                if why:
                    self.unavailable[system] = why
        except Exception as exc:
            what = "the adapter's shim" if self.spec.features else "graphed()"
            self.unavailable[system] = f"unavailable: {what} raised ({short_error(exc)})"

    @property
    def graphed(self) -> Any:
        """The ``defaults`` module (``graphed(tower)``), or None."""
        return self._graphed.get(System.DEFAULTS)

    @property
    def graphed_handle(self) -> Any:
        """What captures and counts for ``defaults``: ``encgraph.graphs(graphed)``, or the FeatureShim."""
        return self._handles.get(System.DEFAULTS)

    # -- inputs
    def inputs(self, visuals: Sequence[Visual], *, max_image_tokens: float = math.inf,
               max_frame_tokens: float = math.inf, seed: int = 0) -> BenchInputs:
        """Random pixels (standard normal, seeded) for ``visuals`` in the layout of this tower."""
        return make_inputs(visuals, self.geom, self.env, self.adapter, seed=seed, max_image_tokens=max_image_tokens,
                           max_frame_tokens=max_frame_tokens)

    # -- systems
    def _captured(self, system: System, capture: Callable[[], dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        info = json_ready(capture())
        self.capture_infos[system] = {"wall_seconds": round(time.perf_counter() - t0, 3), **info}

    def defaults(self, system: System = System.DEFAULTS) -> Any:
        """The ``graphed(tower)`` module of ``system`` (``defaults`` or ``defaults_varlen``), captured (and timed)
        on first use."""
        if system in self.unavailable:
            raise RuntimeError(self.unavailable[system])
        if system not in self.capture_infos:
            self._captured(system, self._handles[system].capture)
        return self._graphed[system]

    def runner(self, system: System) -> Any:
        """The runner of an adapter system (made on first use; graph runners are captured then)."""
        if system in self._runners:
            return self._runners[system]
        from encgraph.capture import EncoderGraphRunner, RunMode

        if system is System.ADAPTER_EAGER:
            # No self-check: it compares the padded static forward with the eager one, and this runner never
            # runs the static forward (the check would only add seconds to its first call).
            runner = EncoderGraphRunner(self.adapter, mode=RunMode.EAGER, verify=False, progress=False)
        elif system is System.GRAPH:
            mode = RunMode.GRAPH if self.env.cuda else RunMode.STATIC
            runner = EncoderGraphRunner(self.adapter, mode=mode, budgets=self.graph_budgets, progress=False)
            self._captured(system, runner.capture)
        elif system is System.COMPILE:
            ref = self.reference_runner()
            runner = EncoderGraphRunner(CompiledStatic(self.adapter), budgets=ref.ladders,
                                        max_items=ref.limits.max_items, max_frames=ref.limits.max_frames,
                                        mode=RunMode.STATIC, progress=False)
            runner.capture()
        elif system is System.GRAPH_COMPILE:
            ref = self.reference_runner()
            # Limits follow from the ladders as for the graph runner (a subset of its ladder keeps its smallest
            # budgets' item cap).
            runner = EncoderGraphRunner(self.adapter, budgets=self.compile_budgets or ref.ladders, compile=True,
                                        progress=False)
            self._captured(system, runner.capture)
        else:
            raise ValueError(f"runner: {system} is not an adapter system")
        self._runners[system] = runner
        return runner

    def reference_runner(self) -> Any:
        """A runner with the graph runner's ladders and limits (they depend on the adapter, not on the mode),
        never captured: what the compiled systems plan with."""
        if System.GRAPH in self._runners:
            return self._runners[System.GRAPH]
        from encgraph.capture import EncoderGraphRunner, RunMode

        return EncoderGraphRunner(self.adapter, mode=RunMode.STATIC, progress=False)

    def compiled_hf(self) -> Any:
        """``torch.compile(hf_tower, dynamic=True)``, made on first use (it compiles on its first calls)."""
        if self._compiled_hf is None:
            self._compiled_hf = compile_dynamic(self.hf, backend=self.compile_backend)
        return self._compiled_hf

    def call(self, system: System, inputs: BenchInputs) -> Callable[[], Any]:
        """A no-argument callable running ``inputs`` through ``system`` (raises if the system is unavailable)."""
        if system in self.unavailable:
            raise RuntimeError(self.unavailable[system])
        args, kwargs = inputs.hf_args, inputs.hf_kwargs
        module = {System.HF_SDPA: lambda: self._entry(self.hf), System.HF_VARLEN: lambda: self._entry(self.enc),
                  System.HF_COMPILE_DYNAMIC: self.compiled_hf, System.DEFAULTS: self.defaults,
                  System.DEFAULTS_VARLEN: lambda: self.defaults(System.DEFAULTS_VARLEN)}.get(system)
        if module is not None:
            fn = module()
            return lambda: fn(*args, **kwargs)
        runner = self.runner(system)
        return lambda: runner(inputs.adapter)

    def _entry(self, model: Any) -> Callable[..., Any]:
        """What a call of the model's own runs: its forward, or the features function the row names."""
        return getattr(model, self.spec.features) if self.spec.features else model

    def stats(self, system: System) -> dict[str, Any]:
        """The runner's counters of a graph or runner system (``runner.stats``)."""
        if system in GRAPHED_SYSTEMS:
            self.defaults(system)
            return self._handles[system].stats
        return self.runner(system).stats

    def reset_stats(self, system: System) -> None:
        if system in GRAPHED_SYSTEMS:
            self.defaults(system)
        (self._handles[system].runner if system in GRAPHED_SYSTEMS else self.runner(system)).reset_stats()

    def plan_summary(self, inputs: BenchInputs) -> list[dict[str, Any]]:
        """The graph runner's plan for ``inputs``: per batch its items and budget per path (None: eager)."""
        plan = self.reference_runner().plan(inputs.adapter)
        return [{"items": len(b.items), "budgets": dict(b.budgets)} for b in plan.batches]

    def plan_budgets(self, inputs: Iterable[BenchInputs]) -> dict[str, tuple[int, ...]]:
        """Per path, the budgets the graph runner's plans of ``inputs`` replay (what ``compile_budgets`` needs)."""
        used: dict[str, set[int]] = {}
        for batch in (b for i in inputs for b in self.plan_summary(i)):
            for path, budget in batch["budgets"].items():
                used.setdefault(path, set())
                if budget:
                    used[path].add(int(budget))
        return {path: tuple(sorted(b)) for path, b in used.items() if b}

    def close(self) -> None:
        """Drop towers, runners and graphs, and return their memory to the device."""
        self._runners.clear()
        self.adapter = self.hf = self.enc = None
        self._graphed.clear()
        self._handles.clear()
        self._graphed_towers.clear()
        self._compiled_hf = None
        free_memory()


def pin_varlen(adapter: Any) -> str | None:
    """Make ``adapter`` (a graphed tower's, before capture) run one packed varlen kernel for every attention call:
    its ``choose_kernels`` still measures (and records) the crossovers and picks the varlen kernel, then its
    ``kernel_rows`` say "never dense" for every geometry measured, so that no sequence of an eager forward runs
    dense. (Before issue 56's retirement this dropped the rows to ``None``, which left eager forwards on the default
    rows, ``attention.SEGMENT_MIN_ROWS``: dense from 2,048 rows, without the plan ledger.) Returns why not, for an
    adapter that chooses no kernels."""
    choose = getattr(adapter, "choose_kernels", None)
    if choose is None or not hasattr(adapter, "kernel_rows"):
        return f"n/a: {type(adapter).__name__} chooses no attention kernels"

    def choose_varlen(known: Any = None) -> Any:
        chosen = choose(known)
        adapter.kernel_rows = {geometry: None for geometry in adapter.kernel_rows or {}}
        return chosen

    adapter.choose_kernels = choose_varlen
    return None
