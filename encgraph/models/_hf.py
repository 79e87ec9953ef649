"""Small helpers for adapters of Hugging Face towers: the transformers version check, a reversible switch of a
tower's attention implementation, and the tower's parameter dtype and device.

Generic on purpose (any adapter may import them); nothing here knows a model family. transformers is imported
on first use only, so that importing encgraph never imports it.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from encgraph.errors import VersionError

__all__ = [
    "AttentionSwitch",
    "repeated_blocks",
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


@attrs.define(eq=False)
class AttentionSwitch:
    """What :func:`switch_attention` changed on a tower: ``engage()`` / ``disengage()`` switch it on and off (the
    ``engaged()`` block: an adapter's own forwards), ``restore()`` puts the tower back for good.

    ``holders`` pairs each submodule whose ``config`` is replaced while engaged with the config object it held
    before and the switched copy. Switching assigns the instance attribute directly (no ``nn.Module.__setattr__``):
    a few microseconds for a tower of 32 blocks, paid by eager forwards only (replays run no Python).
    """

    name: str
    holders: list[tuple[torch.nn.Module, Any, Any]]
    restored: bool = False

    def engage(self) -> None:
        if not self.restored:
            for sub, _, switched in self.holders:
                sub.__dict__["config"] = switched

    def disengage(self) -> None:
        for sub, original, _ in self.holders:
            sub.__dict__["config"] = original

    def restore(self) -> None:
        """Give every submodule its original config object back (idempotent)."""
        self.disengage()
        self.restored = True

    @contextlib.contextmanager
    def engaged(self) -> Iterator[None]:
        """The switched attention inside the block, the tower's own after it."""
        self.engage()
        try:
            yield
        finally:
            self.disengage()


def switch_attention(module: torch.nn.Module, name: str) -> AttentionSwitch:
    """Make the submodules of the tower ``module`` read ``_attn_implementation == name``, without touching any
    config object the caller holds.

    Every submodule below the root that has a ``config`` with an ``_attn_implementation`` gets a shallow copy of
    that config (one copy per distinct config object, shared by the submodules that shared it) with the new
    name; the root keeps its own config, which is the one the caller (and the full model, as its
    ``vision_config``) sees, so building another model from it, or ``type(tower)._from_config(tower.config)``,
    works while the tower is wrapped. The attention modules, which read the name at each call, see the copy.

    A copy rather than an assignment on the shared object: the public ``set_attn_implementation`` rejects names
    that are not known kernels (a registered custom function is exactly that), and mutating the caller's config
    leaks the name into every model built from it. ``_attn_implementation`` is private to transformers, so
    callers check the version first (:func:`require_transformers`) and tests pin the behaviour.
    """
    copies: dict[int, Any] = {}
    holders: list[tuple[torch.nn.Module, Any]] = []
    for sub in module.modules():
        if sub is module:
            continue
        config = sub.__dict__.get("config")
        if config is None or not hasattr(config, "_attn_implementation"):
            continue
        copy_ = copies.get(id(config))
        if copy_ is None:
            copy_ = copies[id(config)] = copy.copy(config)
            _set_attention_name(copy_, name)
        holders.append((sub, config, copy_))
    switch = AttentionSwitch(name=name, holders=holders)
    switch.engage()
    return switch


def _set_attention_name(config: Any, name: str) -> None:
    # The property's setter also writes the name into sub-configs, which a shallow copy shares with the
    # original: write the copy's own field where transformers keeps one (5.x: ``_attn_implementation_internal``).
    if "_attn_implementation_internal" in vars(config):
        vars(config)["_attn_implementation_internal"] = name
    else:
        config._attn_implementation = name


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The tower's repeated layers: every instance of the block class that fills its ``nn.ModuleList`` /
    ``nn.Sequential`` containers most often (at least two of one class in one container; leaf modules and
    containers themselves do not count), outermost instances only, in module order; or ``[]``.

    A container of one class is how towers hold their layers (transformers' ``ModuleList``, timm's and
    torchvision's ``Sequential``); every instance of the class is named, so a staged tower (ConvNeXt's four stages
    of one layer class, at four widths) has all its layers compiled, not only its longest stage's. What
    ``compile_regions()`` of an adapter names by default."""
    counts: dict[type, int] = {}
    for sub in module.modules():
        if type(sub) in _CONTAINERS or isinstance(sub, torch.nn.ModuleList):
            kinds = Counter(type(m) for m in sub.children()
                            if next(m.children(), None) is not None and type(m) not in _CONTAINERS)
            for kind, n in kinds.items():
                if n >= 2:
                    counts[kind] = counts.get(kind, 0) + n
    if not counts:
        return []
    best = max(counts, key=lambda kind: counts[kind])  # ties: the first seen, the outer class
    blocks: list[torch.nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():
        if id(sub) in inside:
            continue
        if type(sub) is best:
            blocks.append(sub)
            inside.update(id(m) for m in sub.modules())
    return blocks


_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList)


def tower_dtype_device(module: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of the tower's first floating-point parameter (float32 on the CPU if it has none)."""
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype, param.device
    return torch.float32, torch.device("cpu")
