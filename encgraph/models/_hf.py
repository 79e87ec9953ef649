"""Small helpers for adapters of Hugging Face towers: the transformers version check, a reversible switch of a
tower's attention implementation, and the tower's parameter dtype and device.

Generic on purpose (any adapter may import them); nothing here knows a model family. transformers is imported
on first use only, so that importing encgraph never imports it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from encgraph.errors import VersionError

__all__ = [
    "AttentionSwitch",
    "require_transformers",
    "switch_attention",
    "tower_dtype_device",
    "transformers_version",
]


def _parse(version: str) -> tuple[int, ...]:
    # "5.17.0.dev0" -> (5, 17, 0); enough to order releases, pre-releases count as their release.
    parts = []
    for piece in version.split(".")[:3]:
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def transformers_version() -> str | None:
    """The installed transformers version string, or ``None`` when it is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    return str(transformers.__version__)


def require_transformers(minimum: str, feature: str) -> str:
    """Raise :class:`~encgraph.VersionError` unless transformers ``>= minimum`` is installed; return its version.

    ``feature`` names what needs it, for the message (e.g. "the Qwen2.5-VL adapter").
    """
    installed = transformers_version()
    if installed is None:
        raise VersionError(
            f"{feature} needs transformers>={minimum}, which is not installed; install it with "
            f"pip install 'transformers>={minimum}' (or the extra: pip install 'encgraph[hf]')."
        )
    if _parse(installed) < _parse(minimum):
        raise VersionError(
            f"{feature} needs transformers>={minimum}, found {installed}; upgrade with "
            f"pip install -U 'transformers>={minimum}'."
        )
    return installed


def _configs(module: torch.nn.Module) -> Iterator[Any]:
    # A tower's blocks usually share its config object, but a model built with ``_from_config`` (or by hand) can
    # hold copies: switch every distinct config that the tower's submodules read their attention from.
    seen: set[int] = set()
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") and id(config) not in seen:
            seen.add(id(config))
            yield config


@attrs.define(eq=False)
class AttentionSwitch:
    """The attention setting of a tower before :func:`switch_attention` changed it; ``restore()`` puts it back.

    ``saved`` pairs each config object with its original ``_attn_implementation``.
    """

    name: str
    saved: list[tuple[Any, Any]]
    restored: bool = False

    def restore(self) -> None:
        """Put every config's original attention implementation back (idempotent)."""
        if self.restored:
            return
        for config, original in self.saved:
            config._attn_implementation = original
        self.restored = True


def switch_attention(module: torch.nn.Module, name: str) -> AttentionSwitch:
    """Set ``_attn_implementation = name`` on every config the tower ``module`` reads, remembering the originals.

    This assigns the config attribute directly: the public ``set_attn_implementation`` rejects names that are not
    known kernels, and a registered custom function is exactly that. The attribute is private to transformers,
    so callers check the version first (:func:`require_transformers`) and tests pin the behaviour.
    """
    saved = [(config, config._attn_implementation) for config in _configs(module)]
    for config, _ in saved:
        config._attn_implementation = name
    return AttentionSwitch(name=name, saved=saved)


def tower_dtype_device(module: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of the tower's first floating-point parameter (float32 on the CPU if it has none)."""
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype, param.device
    return torch.float32, torch.device("cpu")
