"""``graphed(module)``: a drop-in ``nn.Module`` with the wrapped module's forward signature and output type,
backed by an :class:`~encgraph.EncoderGraphRunner`."""

from __future__ import annotations

from typing import Any

import torch

from encgraph._validate import describe
from encgraph.capture.protocol import ModuleAdapter
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.errors import InputTypeError, UnsupportedModelError

__all__ = ["graphed", "GraphedModule"]


class GraphedModule(torch.nn.Module):
    """Holds the original module (so ``.parameters()``, ``.dtype`` and other attributes still answer) and a
    runner; ``forward`` has the original's signature. ``unwrap()`` restores and returns the original."""

    def __init__(self, adapter: Any, runner: EncoderGraphRunner) -> None:
        super().__init__()
        self.inner = adapter.module
        object.__setattr__(self, "adapter", adapter)
        object.__setattr__(self, "runner", runner)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inputs = self.adapter.inputs_from_call(*args, **kwargs)
        results = self.runner(inputs)
        return self.adapter.output_for_call(results, inputs)

    def capture(self) -> dict[str, Any]:
        return self.runner.capture()

    @property
    def stats(self) -> dict[str, Any]:
        return self.runner.stats

    def unwrap(self) -> torch.nn.Module:
        return self.adapter.unwrap()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = super().__getattr__("inner")
            return getattr(inner, name)


def graphed(module: torch.nn.Module, *, adapter_options: dict[str, Any] | None = None, **runner_options: Any) -> GraphedModule:
    """Wrap ``module`` so that its forward replays CUDA graphs (or, on the CPU, runs the padded static forward).

    A known Hugging Face vision tower gets its model adapter (``encgraph.models.wrap``); any other module the
    generic batch-first adapter. ``runner_options`` go to :class:`~encgraph.EncoderGraphRunner` (``budgets``,
    ``max_items``, ``mode``, ...); ``adapter_options`` to the adapter.

    >>> import torch, encgraph
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.GELU())
    >>> fast = encgraph.graphed(net, budgets=[1, 2, 4])
    >>> x = torch.randn(6, 8)
    >>> torch.allclose(fast(x), net(x), atol=1e-6)
    True
    """
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"module: expected a torch.nn.Module, got {describe(module)}.")
    from encgraph.models.generic import GenericModuleAdapter
    from encgraph.models.registry import known_configs, wrap

    options = dict(adapter_options or {})
    try:
        adapter = wrap(module, **options)
    except UnsupportedModelError:
        # A tower whose config an adapter claims, but that adapter refuses (CLIPVisionModelWithProjection shares
        # CLIPVisionConfig), must not silently become a generic module with another output type.
        if type(getattr(module, "config", None)).__name__ in known_configs():
            raise
        adapter = GenericModuleAdapter(module, **options)
    if not isinstance(adapter, ModuleAdapter):
        raise UnsupportedModelError(
            f"module: the {type(adapter).__name__} adapter cannot stand in for {type(module).__name__}'s forward; "
            f"build EncoderGraphRunner(encgraph.models.wrap(module)) and call it from a shim (see "
            f"{type(adapter).__module__})."
        )
    return GraphedModule(adapter, EncoderGraphRunner(adapter, **runner_options))
