"""``graphed(module)``: the module itself, its forward replaying CUDA graphs; ``graphs(module)``: its handle.

Wrapping changes nothing around the module. As accelerate's ``add_hook_to_module`` does, ``graphed`` sets one
instance attribute, ``module.forward``, to a :class:`~encgraph.models.graphed_forward.GraphedForward`, and returns
the same module: its class, identity, parameter names, ``state_dict``, ``save_pretrained`` / ``from_pretrained``,
``load_state_dict`` of the original checkpoint, PEFT's module names, ``deepcopy``, ``pickle`` and ``.to()`` are the
module's own. A model adapter that rewrites layers for speed (the Qwen-VL towers' attention and layouts) does so
only inside its own forwards, never between calls. ``graphs(module).unwrap()`` removes the hook.

Which graphs: a tower a model adapter knows (:mod:`encgraph.models.registry`, by its config class) gets that
adapter (token budgets, its metadata, its output type); any other module (timm, open_clip, torchvision, HF
backbones without an adapter, a user's own) takes the any-module path (:mod:`encgraph.models.generic`): one set of
graphs per call shape, each verified batch-first before any batch is split or padded.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from encgraph._validate import check_int, describe
from encgraph.capture.protocol import ModuleAdapter
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.errors import ConfigError, ConfigTypeError, InputTypeError, UnsupportedModelError
from encgraph.models.engines import Engine
from encgraph.models.graphed_forward import AUTOGRAD, GraphedForward
from encgraph.models.own_forward import HOOK_MARK

__all__ = ["graphed", "graphs", "GraphedForward", "AUTOGRAD"]

log = logging.getLogger("encgraph")


def _runner_options() -> list[str]:
    params = inspect.signature(EncoderGraphRunner.__init__).parameters
    return [name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]


def graphs(module: torch.nn.Module) -> GraphedForward:
    """The hook of a graphed module (``module.forward``): ``stats``, ``capture()``, ``reset()``, ``unwrap()``,
    ``runner``, ``engines``. Raises :class:`~encgraph.ConfigError` for a module that is not graphed."""
    hook = module.__dict__.get("forward") if isinstance(module, torch.nn.Module) else None
    if hook is None or not getattr(hook, HOOK_MARK, False):
        raise ConfigError(
            f"module: expected a module wrapped by encgraph.graphed, got {describe(module)}; wrap it first: "
            "encgraph.graphed(module)."
        )
    return hook


def graphed(
    module: torch.nn.Module,
    *,
    adapter_options: dict[str, Any] | None = None,
    max_shapes: int = 4,
    **runner_options: Any,
) -> torch.nn.Module:
    """Make ``module``'s forward replay CUDA graphs; returns ``module`` itself (so ``tower = graphed(tower)`` and
    ``graphed(tower)`` alone both work). Calling it again on a graphed module rewraps it with the new options.

    Every call the module answers is answered, equal to the module's own forward: a call graphs cannot answer
    exactly goes to the module's own forward, counted in ``graphs(module).stats["eager_reasons"]`` (train mode,
    autograd asked for, the CPU under the default mode, per-layer outputs an adapter does not hold, a call shape
    seen once). ``runner_options`` go to :class:`~encgraph.EncoderGraphRunner` (``budgets``, ``max_items``,
    ``mode``, ``compile``, ``costs``, ``verify``, ...); ``adapter_options`` to the adapter (the any-module path
    takes ``max_batch``); ``max_shapes``: on the any-module path, how many call shapes keep graphs at once (least
    recently used dropped).

    >>> import torch, encgraph
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.GELU())
    >>> fast = encgraph.graphed(net)
    >>> fast is net, list(net.state_dict()) == ["0.weight", "0.bias"]
    (True, True)
    >>> x = torch.randn(6, 8)
    >>> torch.allclose(fast(x), torch.nn.functional.gelu(x @ net[0].weight.T + net[0].bias))
    True
    """
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"module: expected a torch.nn.Module, got {describe(module)}.")
    valid = _runner_options()
    unknown = sorted(set(runner_options) - set(valid))
    if unknown:
        raise ConfigTypeError(
            f"graphed(): unknown option{'s' if len(unknown) > 1 else ''} {unknown}; expected runner options "
            f"{valid}, max_shapes=N, or adapter_options={{...}} for the adapter."
        )
    max_shapes = check_int("max_shapes", max_shapes, minimum=1)
    options = dict(adapter_options or {})
    existing = module.__dict__.get("forward")
    if existing is not None and getattr(existing, HOOK_MARK, False):
        existing.unwrap()
    engine = _family_engine(module, options, runner_options)
    if engine is None:
        _check_generic_options(options)
        _check_runner_options(module, options, runner_options)
    hook = GraphedForward(
        module, original=module.__dict__.get("forward"), family=engine is not None, adapter_options=options,
        runner_options=runner_options, max_shapes=max_shapes, engine=engine,
    )
    module.__dict__["forward"] = hook
    return module


def _family_engine(module: torch.nn.Module, options: dict[str, Any], runner_options: dict[str, Any]) -> Engine | None:
    """The model adapter's engine, or ``None`` when no model adapter takes ``module`` (the any-module path)."""
    from encgraph.models.registry import known_configs, wrap

    if type(getattr(module, "config", None)).__name__ not in known_configs():
        return None
    try:
        adapter = wrap(module, **options)
    except UnsupportedModelError as why:
        # A tower whose config an adapter knows but whose class it does not take (CLIPVisionModelWithProjection
        # shares CLIPVisionConfig): the any-module path answers it with its own output type.
        log.info("encgraph: %s goes on the any-module path (%s).", type(module).__name__, why)
        return None
    if not isinstance(adapter, ModuleAdapter):
        getattr(adapter, "unwrap", lambda: None)()
        raise UnsupportedModelError(
            f"module: {type(module).__name__} is a whole model whose encoder encgraph runs through a runner, not "
            f"through the model's forward; build encgraph.EncoderGraphRunner(encgraph.models.wrap(module)) and call "
            f"it from a shim (see {type(adapter).__module__}), or wrap its vision tower instead."
        )
    try:
        return Engine(adapter, EncoderGraphRunner(adapter, **runner_options))
    except BaseException:
        adapter.unwrap()  # a bad option must not leave the tower rewritten
        raise


def _check_generic_options(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - {"max_batch"})
    if unknown:
        raise ConfigTypeError(
            f"adapter_options: unknown option{'s' if len(unknown) > 1 else ''} {unknown} for the any-module path; "
            "it takes max_batch (the largest batch size captured)."
        )
    if "max_batch" in options:
        check_int("adapter_options['max_batch']", options["max_batch"], minimum=1)


def _check_runner_options(module: torch.nn.Module, options: dict[str, Any], runner_options: dict[str, Any]) -> None:
    """A bad runner option fails at wrap time, as for a model adapter, not at some later call: a runner is built
    (construction does no device work) over a scratch call shape, and dropped."""
    from encgraph.models.call_spec import split_call
    from encgraph.models.generic import GenericModuleAdapter, OutputSpec

    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if device.type == "meta":
        return
    scratch = torch.zeros(1, 1, device=device)
    split = split_call((scratch,), {})
    output = OutputSpec.learn(scratch, 1)
    assert not isinstance(split, str) and not isinstance(output, str)
    EncoderGraphRunner(GenericModuleAdapter(module, split, output, **options), **runner_options)
