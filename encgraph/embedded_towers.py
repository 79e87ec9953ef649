"""The embedded towers: tiny random-weight Hugging Face vision towers built from the configs shipped in
``encgraph/configs/*.json``, which ``encgraph demo`` runs and ``encgraph serve`` serves by default.

Importing this module is cheap (the command line lists ``--model`` choices from it); building a tower imports
torch and transformers. No download: the configs are package data and the weights are random (seeded).
The demo's batches for these towers are :mod:`encgraph.cli.demo_batches`.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

import attrs

from encgraph.errors import VersionError

if TYPE_CHECKING:  # torch is imported when a tower is built, not when the command line is parsed
    import torch

__all__ = ["DemoTower", "TOWERS", "load_config", "build_tower"]


@attrs.frozen
class DemoTower:
    """One ``--model`` choice.

    Attributes:
        name: the ``--model`` value; also the config file's stem.
        budgets: the demo's default ladder (tokens for variable-size towers, images for fixed-size ones); for a
            multi-path tower, ``{path: ladder}``.
        geometry: for a Qwen-VL tower (items of several sizes: pixel rows + ``grid_thw``), the processor
            geometry in :data:`encgraph.cli.geometry.TOWERS` (by name); ``None`` for a fixed-size tower.
    """

    name: str
    budgets: tuple[int, ...] | Mapping[str, tuple[int, ...]]
    geometry: str | None


TOWERS: dict[str, DemoTower] = {
    t.name: t
    for t in (
        DemoTower("qwen2_5_vl", (32, 64, 128), geometry="qwen2_5_vl"),
        DemoTower("qwen3_vl", (32, 64, 128), geometry="qwen3_vl"),
        DemoTower("siglip", (1, 2, 4, 8), geometry=None),
        # Two paths: items of at most 70 soft tokens (video frames, small images) and larger images.
        DemoTower("gemma4", {"image": (140, 280), "video": (70, 140)}, geometry=None),
    )
}


def load_config(name: str) -> dict[str, Any]:
    """The shipped JSON ``encgraph/configs/<name>.json``: a tower's config envelope (description, module,
    classes, config) or, for ``<tower>_processor``, its image processor's config."""
    text = resources.files("encgraph").joinpath("configs", f"{name}.json").read_text(encoding="utf-8")
    return json.loads(text)


def build_tower(name: str, *, seed: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
    """Build the shipped tower ``name`` with seeded random weights on ``device`` in ``dtype``, in eval mode.

    Returns the tower and its one-line description.

    Raises:
        VersionError: transformers is missing or lacks the tower's classes.
    """
    import torch

    envelope = load_config(name)
    try:
        import transformers

        modeling = importlib.import_module(envelope["module"])
    except ImportError as exc:
        raise VersionError(
            f"--model {name}: needs transformers with {envelope['model_class']} ({exc}); install it with "
            f"pip install 'encgraph[hf]'."
        ) from None
    config_cls = getattr(transformers, envelope["config_class"], None) or getattr(modeling, envelope["config_class"])
    model_cls = getattr(modeling, envelope["model_class"])
    config = config_cls(**envelope["config"])
    torch.manual_seed(seed)
    tower = model_cls._from_config(config)
    return tower.to(device=device, dtype=dtype).eval(), envelope["description"]
