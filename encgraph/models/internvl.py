"""InternVL vision towers (``InternVLVisionModel``, InternViT on 448 px tiles): a fixed-resolution batch ladder.

A tile is an item: InternVL's processor cuts each image into tiles (plus a thumbnail) and stacks them as
``pixel_values (tiles, 3, 448, 448)``, so one call's images share the ladder tile by tile.

Outputs: ``last_hidden_state (B, 1 + (S/P)^2, hidden)`` only: the tower's forward leaves ``pooler_output``
``None`` (with or without ``use_mean_pooling``). Position embeddings interpolate by themselves for another
``image_size``. ``bool_masked_pos`` (masked-image pretraining) is not supported. See
:mod:`encgraph.models.fixed`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from encgraph.models.fixed import FixedResolutionAdapter

__all__ = ["InternVLAdapter", "internvl_adapter"]


class InternVLAdapter(FixedResolutionAdapter):
    """Adapter for ``transformers.InternVLVisionModel`` (options: see :class:`FixedResolutionAdapter`)."""

    family: ClassVar[str] = "InternVL"
    tower_class_names: ClassVar[tuple[str, ...]] = ("InternVLVisionModel",)
    positional: ClassVar[tuple[str, ...]] = ("pixel_values", "bool_masked_pos")
    interpolate_kwarg: ClassVar[str | None] = None
    none_only: ClassVar[tuple[str, ...]] = ("bool_masked_pos",)
    output_class_name: ClassVar[str] = "InternVLVisionModelOutputWithPooling"

    def _has_pooler(self) -> bool:
        return False


def internvl_adapter(module: torch.nn.Module, **options: Any) -> InternVLAdapter:
    """Registry factory: the adapter for an ``InternVLVisionModel`` (``InternVLVisionConfig``)."""
    return InternVLAdapter(module, **options)
