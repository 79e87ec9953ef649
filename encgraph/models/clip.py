"""CLIP vision towers (``CLIPVisionModel``: LLaVA): a fixed-resolution batch ladder.

Outputs: ``last_hidden_state (B, 1 + (S/P)^2, hidden)`` (class token first, before the post-layernorm) and
``pooler_output (B, hidden)`` (the post-layernormed class token). LLaVA reads ``hidden_states[-2]``: the adapter
learns that from the first call (or take ``hidden_states=[-2]``). See :mod:`encgraph.models.fixed`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from encgraph.models.fixed import FixedResolutionAdapter

__all__ = ["ClipAdapter", "clip_adapter"]


class ClipAdapter(FixedResolutionAdapter):
    """Adapter for ``transformers.CLIPVisionModel`` (options: see :class:`FixedResolutionAdapter`).

    ``CLIPVisionModelWithProjection`` shares the config class but returns ``image_embeds``; it is not taken.
    """

    family: ClassVar[str] = "CLIP"
    tower_class_names: ClassVar[tuple[str, ...]] = ("CLIPVisionModel",)


def clip_adapter(module: torch.nn.Module, **options: Any) -> ClipAdapter:
    """Registry factory: the adapter for a ``CLIPVisionModel`` (``CLIPVisionConfig``)."""
    return ClipAdapter(module, **options)
