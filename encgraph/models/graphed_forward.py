"""The hook ``encgraph.graphed(module)`` installs as ``module.forward``: every call of the module goes through it.

What it answers with, per call, in this order:

1. the module's own forward (its forward before wrapping, :func:`~encgraph.models.own_forward.own_forward`),
   counted in ``stats["eager_reasons"]`` and logged once per reason, where graphs cannot answer exactly: the
   module in train mode (BatchNorm statistics, dropout), autograd asked for, the module on the CPU under the
   default mode (no graphs to gain: the call costs what the module's does), a call the adapter does not hold (per
   layer attentions, an image size not captured), a call shape seen for the first time (the any-module path learns
   the output's structure from that answer), a shape that cannot be split per item, a shape whose self-check
   found rows mixing;
2. else the graphs: the model adapter's runner, or the runner of the call's shape (:mod:`encgraph.models.engines`).

Before that, the module is checked against what its graphs were built for (:mod:`encgraph.models.module_state`):
after ``.to()``, ``.half()``, replaced parameters or an injected LoRA layer, every engine is dropped and rebuilt on
demand, counted in ``stats["rebuilds"]``.

The hook holds no tensor state a copy could share: ``copy.deepcopy`` and ``pickle`` of the module carry the hook's
options only, and a copy captures again, lazily, on its own calls.
"""

from __future__ import annotations

import collections
import inspect
import logging
import threading
from typing import Any

import torch

from encgraph.capture.grad import autograd_requested
from encgraph.capture.protocol import StockCall
from encgraph.capture.records import RunMode
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.capture.stats import RunStats, sum_counters
from encgraph.errors import ConfigError
from encgraph.models.call_spec import split_call
from encgraph.models.engines import Engine, ShapeFamilies, new_generic_engine
from encgraph.models.generic import OutputSpec
from encgraph.models.module_state import ModuleState, buffers_restored, watch_registrations

__all__ = ["GraphedForward", "AUTOGRAD", "TRAIN_MODE", "CPU_PASSTHROUGH", "FIRST_SIGHT"]

log = logging.getLogger("encgraph")

AUTOGRAD = "autograd requested"
"""The ``eager_reasons`` key of calls with grad enabled and an input or parameter that requires grad."""
TRAIN_MODE = "module in train mode"
CPU_PASSTHROUGH = "no graphs on the CPU (default mode)"
FIRST_SIGHT = "first call of this shape"
UNVERIFIED = "batch-first not verified (RunMode.EAGER runs no self-check)"

_HINTS = {
    AUTOGRAD: " Call the model under torch.no_grad() or torch.inference_mode() (or requires_grad_(False) on the "
              "module) for the graphs.",
    TRAIN_MODE: " Call module.eval() for the graphs.",
}


class GraphedForward:
    """``module.forward`` of a graphed module. Public: :attr:`stats`, :meth:`capture`, :meth:`reset`,
    :meth:`unwrap`, :attr:`engines`; :attr:`runner` and :attr:`adapter` (the model adapter's, or the most recently
    used call shape's)."""

    _encgraph_hook = True

    def __init__(self, module: torch.nn.Module, *, original: Any, family: bool, adapter_options: dict[str, Any],
                 runner_options: dict[str, Any], max_shapes: int, engine: Engine | None = None) -> None:
        self.module = module
        self._original = original
        self._family = family
        self._adapter_options = dict(adapter_options)
        self._runner_options = dict(runner_options)
        self.max_shapes = max_shapes
        self._init_transient(engine)

    def _init_transient(self, engine: Engine | None = None) -> None:
        # What a copy does not share: rebuilt at the first call (a copy, or an unpickled module, captures anew).
        watch_registrations()  # once per process: replaced parameters and submodules are seen at the next call
        self._lock = threading.RLock()
        self._engine = engine  # the model adapter's (family modules)
        self._shapes = ShapeFamilies(self._build_shape, self.max_shapes)
        self._state: ModuleState | None = None  # read at the first call: the module may still be unpickling
        self._passthrough: str | None = None
        self._stock = RunStats(("default",))
        self._rebuilds: collections.Counter[str] = collections.Counter()
        self._logged: set[str] = set()

    # ------------------------------------------------------------------ what callers see
    @property
    def original_forward(self) -> Any:
        """The module's forward before wrapping (bound), what the stock path and adapters call."""
        if self._original is not None:
            return self._original
        return type(self.module).forward.__get__(self.module)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.original_forward)

    @property
    def __name__(self) -> str:  # noqa: D401 - what tools printing a forward expect
        return "forward"

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return getattr(self.original_forward, "__doc__", None)

    @property
    def family(self) -> bool:
        """Whether a model adapter answers the module (else the any-module path: one engine per call shape)."""
        return self._family

    @property
    def max_batch(self) -> int:
        """On the any-module path, the largest batch a call shape's graphs hold (the top of ``budgets`` if given)."""
        budgets = self._runner_options.get("budgets")
        if budgets is not None and not isinstance(budgets, dict):
            return max(int(b) for b in budgets)
        return int(self._adapter_options.get("max_batch", 32))

    @property
    def device(self) -> torch.device:
        param = next(self.module.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def holds(self, split: Any) -> bool:
        """Whether graphs answer calls of ``split``'s shape (a :class:`~encgraph.models.call_spec.CallSplit`):
        the shape was seen and its answers split per item; a serving front coalesces only such calls."""
        with self._lock:
            return not self._family and isinstance(self._shapes.learned.get(split.key), OutputSpec)

    def check(self) -> None:
        """What every call does first: drop the graphs if the module changed since they were built."""
        with self._lock:
            self._check_state()

    def __repr__(self) -> str:
        kind = "model adapter" if self._family else f"any-module path, max_shapes={self.max_shapes}"
        return f"<encgraph graphed forward of {type(self.module).__name__} ({kind})>"

    # ------------------------------------------------------------------ the call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if module.training:
            return self._answer_stock(TRAIN_MODE, args, kwargs)
        if autograd_requested(module, args, kwargs):
            return self._answer_stock(AUTOGRAD, args, kwargs)
        with self._lock:  # one acquisition a call: the state check, then the graphs' call
            self._check_state()
            passthrough = self._passthrough
            if passthrough is None:
                return self._call_family(args, kwargs) if self._family else self._call_shape(args, kwargs)
            self._stock.add_stock(passthrough)
        # Outside the lock: the module's forward, as concurrent as the module is.
        if passthrough not in self._logged:
            self._log_stock(passthrough)
        return self.original_forward(*args, **kwargs)

    def _call_family(self, args: Any, kwargs: Any) -> Any:
        engine = self._engine
        if engine is None:
            engine = self._engine = self._build_family()
        inputs = engine.adapter.inputs_from_call(*args, **kwargs)
        if isinstance(inputs, StockCall):
            return self._answer_stock(inputs.reason, args, kwargs)
        return self._run(engine, inputs, args, kwargs)

    def _call_shape(self, args: Any, kwargs: Any) -> Any:
        split = split_call(args, kwargs)
        if isinstance(split, str):
            return self._answer_stock(split, args, kwargs)
        if split.batch == 0:
            return self._answer_stock("empty batch", args, kwargs)
        found = self._shapes.engine(split)
        if found is None:  # first sight: the module answers, and its answer teaches the output's structure
            out = self._answer_stock(FIRST_SIGHT, args, kwargs)
            self._shapes.learn(split, out)
            return out
        if isinstance(found, str):
            return self._answer_stock(found, args, kwargs)
        assert isinstance(found, Engine)
        out = self._run(found, split, args, kwargs)
        reason = found.adapter.stock_reason
        if reason is not None:  # the self-check failed: this shape is the module's from now on
            self._shapes.forget(split.key, reason)
        return out

    def _run(self, engine: Engine, inputs: Any, args: Any, kwargs: Any) -> Any:
        adapter, runner = engine.adapter, engine.runner
        if not runner.captured:
            # Capture, self-check and cost model run on scratch inputs; the module's buffers are left as they were.
            with buffers_restored(self.module):
                runner.prepare(inputs)
                if not self._family:
                    _verified(engine)
        reason = getattr(adapter, "stock_reason", None)
        if reason:
            return self._answer_stock(reason, args, kwargs)
        by_rows = getattr(adapter, "output_for_rows", None)
        if by_rows is not None:  # a batch ladder: the outputs as rows, not cut per item and joined again
            rows = runner.call_rows(inputs)
            if rows is not None:
                return by_rows(rows, inputs)
        return adapter.output_for_call(runner(inputs), inputs)

    def _answer_stock(self, reason: str, args: Any, kwargs: Any) -> Any:
        """The module's own forward, counted once per call and logged once per reason."""
        with self._lock:
            self._stock.add_stock(reason)
        if reason not in self._logged:
            self._log_stock(reason)
        return self.original_forward(*args, **kwargs)

    def _log_stock(self, reason: str) -> None:
        with self._lock:
            if reason in self._logged:
                return
            self._logged.add(reason)
        log.info("encgraph: graphed %s answers calls with %s by its own forward.%s", type(self.module).__name__,
                 reason, _HINTS.get(reason, ""))

    # ------------------------------------------------------------------ engines and the module's state
    def _check_state(self) -> None:
        state = self._state
        if state is None:
            self._state = ModuleState.of(self.module)
            self._refresh_mode()
            return
        reason = state.changed(self.module)
        if reason is not None:
            self._drop_engines(reason)

    def _drop_engines(self, reason: str) -> None:
        self._rebuilds[reason] += 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("encgraph: graphed %s: %s; its graphs are dropped and built again on demand.",
                     type(self.module).__name__, reason)
        self._close_engines()
        self._state = ModuleState.of(self.module)
        self._refresh_mode()

    def _close_engines(self) -> None:
        """Every engine goes (the adapters undo what they changed); their counters stay in ``stats``."""
        if self._engine is not None:
            self._shapes.retire(self._engine)
            self._engine = None
        self._shapes.clear()

    def _refresh_mode(self) -> None:
        mode = self._runner_options.get("mode")
        param = next(self.module.parameters(), None)
        on_cpu = param is None or param.device.type != "cuda"
        self._passthrough = None
        if mode is None and on_cpu:
            self._passthrough = CPU_PASSTHROUGH
        elif mode is RunMode.EAGER and not self._family:
            self._passthrough = UNVERIFIED

    def _build_family(self) -> Engine:
        from encgraph.models.registry import wrap

        adapter = wrap(self.module, **self._adapter_options)
        try:
            engine = Engine(adapter, EncoderGraphRunner(adapter, **self._runner_options))
        except BaseException:
            adapter.unwrap()
            raise
        # The module as the graphs will see it: an adapter may re-point parameters' storage (Qwen2.5-VL's padded
        # MLP), which must not read as a change at the next call (it would rebuild the adapter, forever).
        self._state = ModuleState.of(self.module)
        return engine

    def _build_shape(self, split: Any, output: Any) -> Engine:
        return new_generic_engine(self.module, split, output, self._adapter_options, self._runner_options)

    @property
    def engines(self) -> list[Engine]:
        """The live engines: the model adapter's, or one per call shape (most recently used last)."""
        with self._lock:
            if self._family:
                return [self._engine] if self._engine is not None else []
            return list(self._shapes.engines.values())

    @property
    def runner(self) -> EncoderGraphRunner:
        engines = self.engines
        if not engines:
            if self._family:
                with self._lock:
                    self._engine = self._engine or self._build_family()
                    return self._engine.runner
            raise ConfigError(
                f"graphed {type(self.module).__name__}: no runner yet: the any-module path builds one per call shape "
                "from the shape's second call; call the module first."
            )
        return engines[-1].runner

    @property
    def adapter(self) -> Any:
        return self.runner.adapter

    def capture(self) -> dict[str, Any]:
        """Capture the model adapter's graphs now (instead of on the first call). On the any-module path the graphs
        of a call shape are captured on that shape's second call; this captures the live ones not captured yet."""
        with self._lock, buffers_restored(self.module):
            infos = [e.runner.capture() for e in self._engines_for_capture()]
        return infos[0] if len(infos) == 1 else {"shapes": infos}

    def _engines_for_capture(self) -> list[Engine]:
        if self._family and self._engine is None:
            self._engine = self._build_family()
        return self.engines

    def reset(self) -> None:
        """Drop every graph and learned shape now (after a change :mod:`~encgraph.models.module_state` cannot see,
        such as casting one submodule); they are built again on demand."""
        with self._lock:
            self._drop_engines("reset() called")

    def unwrap(self) -> torch.nn.Module:
        """Remove the hook: the module's forward is again what it was before wrapping; returns the module."""
        with self._lock:
            self._close_engines()
            if self.module.__dict__.get("forward") is self:
                del self.module.__dict__["forward"]
                if self._original is not None:
                    self.module.__dict__["forward"] = self._original
        return self.module

    # ------------------------------------------------------------------ reporting
    @property
    def stats(self) -> dict[str, Any]:
        """The runners' counters (summed over call shapes, the dropped ones included) and the module's own-forward
        calls: ``calls`` (calls the graphs' runners answered), ``stock_calls`` (calls the module's forward answered)
        and ``eager_reasons`` (per reason: items for the runners' eager batches, calls for the module's), plus
        ``rebuilds`` (per reason) and, on the any-module path, ``shapes`` (live shapes, their graph memory)."""
        with self._lock:
            engines = self.engines
            live = [e.runner.stats for e in engines]
            base = dict(live[-1]) if live else {**self._stock.as_dict(), "stock_calls": 0, "eager_reasons": {}}
            counted = sum_counters([self._shapes.retired, *live, self._stock.as_dict()])
            for key in ("calls", "stock_calls", "items", "graph_items", "eager_items", "eager_reasons", "paths"):
                if key in counted:
                    base[key] = counted[key]
            for path in base.get("paths", {}).values():  # a share is no sum: from the summed tokens again
                tokens = path.get("padded_tokens", 0) + path.get("real_tokens", 0)
                path["padded_share"] = path.get("padded_tokens", 0) / tokens if tokens else 0.0
            base.setdefault("eager_reasons", {})
            base["rebuilds"] = dict(self._rebuilds)
            if not self._family:
                base["shapes"] = self._shapes.as_dict()
            return base

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> dict[str, Any]:
        # Options only: a copy builds its own engines (its own graphs, over its own tensors) on demand.
        return {"module": self.module, "original": self._original, "family": self._family,
                "adapter_options": self._adapter_options, "runner_options": self._runner_options,
                "max_shapes": self.max_shapes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.module = state["module"]
        self._original = state["original"]
        self._family = state["family"]
        self._adapter_options = state["adapter_options"]
        self._runner_options = state["runner_options"]
        self.max_shapes = state["max_shapes"]
        self._init_transient()


def _verified(engine: Engine) -> None:
    """A call shape is held only if its self-check passed at every budget: a budget that disagreed, or whose check
    raised (an output of another row count than its batch), means the module is not batch-first for that shape,
    whatever the other budgets did (a module that packs its items into one sequence agrees at a batch of one); and
    only if each item's answer is the same alone as beside others (the split check: a module that switches for the
    whole batch when one item is padded agrees with itself padded, but not split)."""
    adapter, runner = engine.adapter, engine.runner
    if not runner.verify:
        return
    for path, failed in runner.failed.items():
        for budget, why in failed.items():
            if why.startswith("self-check") and adapter.stock_reason is None:
                adapter.selfcheck_failed(path, budget, why)
    if adapter.stock_reason is None:
        from encgraph.capture.agreement import tolerance

        adapter.split_check(tolerance(runner.config.dtype, runner.device))
