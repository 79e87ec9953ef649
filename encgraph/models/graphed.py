"""``graphed(module)``: a drop-in ``nn.Module`` with the wrapped module's forward signature and output type,
backed by an :class:`~encgraph.EncoderGraphRunner`.

Every valid call is answered as the module answers it. Calls the graphs cannot answer exactly (per-layer hidden
states or attentions the graphs do not hold, autograd asked for) are answered by the module's own forward: the
adapter says so by returning :class:`~encgraph.models.protocol.StockCall` from ``inputs_from_call``, and
autograd is detected here (grad mode on and an input or a parameter requires grad: a captured graph cannot
replay a backward pass). Such calls are counted in ``stats["eager_reasons"]`` (one per call) and
``stats["stock_calls"]``, and each reason is logged once.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from typing import Any

import torch

from encgraph._validate import describe
from encgraph.capture.grad import autograd_requested
from encgraph.capture.protocol import ModuleAdapter, StockCall
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.errors import ConfigError, ConfigTypeError, InputTypeError, UnsupportedModelError

__all__ = ["graphed", "GraphedModule", "AUTOGRAD"]

log = logging.getLogger("encgraph")

AUTOGRAD = "autograd requested"
"""The ``eager_reasons`` key of calls with grad enabled and an input or parameter that requires grad."""


class GraphedModule(torch.nn.Module):
    """Holds the original module (so ``.parameters()``, ``.config``, ``.dtype`` and other attributes still
    answer) and a runner; ``forward`` has the original's signature. ``unwrap()`` restores and returns the
    original; the graphed module cannot be called after it."""

    def __init__(self, adapter: Any, runner: EncoderGraphRunner) -> None:
        super().__init__()
        self.inner = adapter.module
        object.__setattr__(self, "adapter", adapter)
        object.__setattr__(self, "runner", runner)
        object.__setattr__(self, "_unwrapped", False)
        object.__setattr__(self, "_logged", set())
        object.__setattr__(self, "_log_lock", threading.Lock())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._unwrapped:
            raise ConfigError(
                f"graphed {type(self.inner).__name__}: called after unwrap(); call the module unwrap() returned "
                "(or wrap it again with encgraph.graphed)."
            )
        if autograd_requested(self.inner, args, kwargs):
            return self._stock(AUTOGRAD, args, kwargs)
        inputs = self.adapter.inputs_from_call(*args, **kwargs)
        if isinstance(inputs, StockCall):
            return self._stock(inputs.reason, args, kwargs)
        if not self.runner.captured:
            self.runner.prepare(inputs)  # capture (and self-check) before planning this very call
        reason = getattr(self.adapter, "stock_reason", None)
        if reason:
            return self._stock(reason, args, kwargs)
        results = self.runner(inputs)
        return self.adapter.output_for_call(results, inputs)

    def _stock(self, reason: str, args: Any, kwargs: Any) -> Any:
        """The module's own forward (what wrapping changed put back for the call), counted and logged once."""
        with self._log_lock:
            first = reason not in self._logged
            self._logged.add(reason)
        if first:
            hint = (
                " Call the model under torch.no_grad() or torch.inference_mode() (or set requires_grad_(False) on "
                "the tower) for the graphs." if reason == AUTOGRAD else ""
            )
            log.info("encgraph: graphed %s answers calls with %s by its own forward.%s", type(self.inner).__name__,
                     reason, hint)
        context = getattr(self.adapter, "stock_context", None)
        # Under the runner's lock: the context switches the tower's attention back, which a concurrent replay
        # must not see (calls are serialised anyway).
        with self.runner._lock, (context() if context is not None else contextlib.nullcontext()):
            self.runner._stats.add_stock(reason)
            return self.inner(*args, **kwargs)

    def capture(self) -> dict[str, Any]:
        return self.runner.capture()

    @property
    def stats(self) -> dict[str, Any]:
        return self.runner.stats

    def unwrap(self) -> torch.nn.Module:
        object.__setattr__(self, "_unwrapped", True)
        return self.adapter.unwrap()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = super().__getattr__("inner")
            return getattr(inner, name)


def _runner_options() -> list[str]:
    params = inspect.signature(EncoderGraphRunner.__init__).parameters
    return [name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]


def _is_hf_model(module: torch.nn.Module) -> bool:
    # By class name, so that checking never imports transformers.
    return any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)


def graphed(module: torch.nn.Module, *, adapter_options: dict[str, Any] | None = None, **runner_options: Any) -> GraphedModule:
    """Wrap ``module`` so that its forward replays CUDA graphs (on the CPU, by default, runs the adapter's eager
    forward: no graphs to gain, so nothing is captured or padded; ``mode=RunMode.STATIC`` runs the padded plan).

    A known Hugging Face vision tower gets its model adapter (``encgraph.models.wrap``); a Hugging Face model no
    adapter knows is refused (:class:`~encgraph.UnsupportedModelError`, naming the supported families); any other
    module gets the generic batch-first adapter. ``runner_options`` go to :class:`~encgraph.EncoderGraphRunner`
    (``budgets``, ``max_items``, ``mode``, ``compile``, ``costs``, ``verify``, ...); ``adapter_options`` to the
    adapter.

    >>> import torch, encgraph
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.GELU())
    >>> fast = encgraph.graphed(net, budgets=[1, 2, 4])
    >>> x = torch.randn(6, 8)
    >>> torch.allclose(fast(x), net(x), atol=1e-6)
    True
    """
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"module: expected a torch.nn.Module, got {describe(module)}.")
    valid = _runner_options()
    unknown = sorted(set(runner_options) - set(valid))
    if unknown:
        raise ConfigTypeError(
            f"graphed(): unknown option{'s' if len(unknown) > 1 else ''} {unknown}; expected runner options "
            f"{valid} or adapter_options={{...}} for the adapter."
        )
    from encgraph.models.generic import GenericModuleAdapter
    from encgraph.models.registry import known_configs, supported_families, wrap

    options = dict(adapter_options or {})
    try:
        adapter = wrap(module, **options)
    except UnsupportedModelError:
        # A tower whose config an adapter claims, but that adapter refuses (CLIPVisionModelWithProjection shares
        # CLIPVisionConfig), must not silently become a generic module with another output type; neither may a
        # Hugging Face model that no adapter knows (it takes keywords, grids, masks the generic adapter cannot).
        if type(getattr(module, "config", None)).__name__ in known_configs():
            raise
        if _is_hf_model(module):
            raise UnsupportedModelError(
                f"module: no encgraph adapter knows {type(module).__name__} (config "
                f"{type(getattr(module, 'config', None)).__name__}); supported families: {supported_families()}. "
                "Wrap its vision tower (e.g. model.model.visual) if it is one of those, or write an adapter "
                "(encgraph.models.protocol) and register it (encgraph.models.registry.register_adapter)."
            ) from None
        adapter = GenericModuleAdapter(module, **options)
    if not isinstance(adapter, ModuleAdapter):
        raise UnsupportedModelError(
            f"module: the {type(adapter).__name__} adapter cannot stand in for {type(module).__name__}'s forward; "
            f"build EncoderGraphRunner(encgraph.models.wrap(module)) and call it from a shim (see "
            f"{type(adapter).__module__})."
        )
    try:
        runner = EncoderGraphRunner(adapter, **runner_options)
    except BaseException:
        adapter.unwrap()  # a bad option must not leave the tower rewritten
        raise
    return GraphedModule(adapter, runner)
