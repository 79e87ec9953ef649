"""``wrap(module)``: pick the adapter for a Hugging Face vision tower by its config class.

Adapters register here by config class name with the module path of their factory, imported on first use (so
that wrapping a SigLIP tower does not import the Qwen code). The built-in ones are the table
:data:`encgraph.models.builtin.BUILTIN_ADAPTERS`; ``register_adapter`` adds or replaces entries.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from encgraph._validate import describe
from encgraph.errors import UnsupportedModelError
from encgraph.models.builtin import BUILTIN_ADAPTERS

__all__ = ["wrap", "register_adapter", "known_configs", "supported_families"]


def _family(config_class_name: str, family: str | None) -> str:
    return family or config_class_name.removesuffix("Config")


# config class name -> "module:factory"; a factory takes (module, **options) and returns an adapter.
_REGISTRY: dict[str, str] = {c: factory for c, (factory, _) in BUILTIN_ADAPTERS.items()}
# config class name -> the family's name for messages and docs ("Qwen2.5-VL").
_FAMILIES: dict[str, str] = {c: _family(c, family) for c, (_, family) in BUILTIN_ADAPTERS.items()}


def register_adapter(config_class_name: str, factory: str, family: str | None = None) -> None:
    """Register ``factory`` ("package.module:callable") for towers whose ``config`` class has this name (a
    built-in entry is replaced); ``family`` names the model family in messages (default: the config name without
    "Config")."""
    _REGISTRY[config_class_name] = factory
    _FAMILIES[config_class_name] = _family(config_class_name, family)


def supported_families() -> list[str]:
    """The model families that have an adapter, each once, in registration order."""
    return list(dict.fromkeys(_FAMILIES[c] for c in _REGISTRY))


def known_configs() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def wrap(module: torch.nn.Module, **options: Any) -> Any:
    """The model adapter for a known Hugging Face vision tower (chosen by ``type(module.config).__name__``).

    Raises :class:`~encgraph.UnsupportedModelError` (a ``TypeError``) for anything else.
    """
    config = getattr(module, "config", None)
    name = type(config).__name__ if config is not None else None
    if name not in _REGISTRY:
        raise UnsupportedModelError(
            f"module: no encgraph adapter for {describe(module)} with config {name}; known configs: "
            f"{list(known_configs())}. For a batch-first module use encgraph.graphed(module), which falls back "
            "to the generic adapter."
        )
    module_name, attr = _REGISTRY[name].split(":")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory(module, **options)

