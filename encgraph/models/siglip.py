"""SigLIP vision towers (``SiglipVisionModel``: PaliGemma, Gemma3): a fixed-resolution batch ladder.

Outputs: ``last_hidden_state (B, (S/P)^2, hidden)`` after the post-layernorm, and ``pooler_output (B, hidden)``
from the attention-pooling head where the tower has one (``vision_use_head``; PaliGemma's and Gemma3's towers
have none). See :mod:`encgraph.models.fixed` for the layout, the buffers and the call options.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from encgraph.models.fixed import FixedResolutionAdapter

__all__ = ["SiglipAdapter", "siglip_adapter"]


class SiglipAdapter(FixedResolutionAdapter):
    """Adapter for ``transformers.SiglipVisionModel`` (options: see :class:`FixedResolutionAdapter`)."""

    family: ClassVar[str] = "SigLIP"
    tower_class_names: ClassVar[tuple[str, ...]] = ("SiglipVisionModel",)

    def _has_pooler(self) -> bool:
        # The forward returns pooler_output only when the tower was built with its pooling head.
        return bool(getattr(self._module, "use_head", False))


def siglip_adapter(module: torch.nn.Module, **options: Any) -> SiglipAdapter:
    """Registry factory: the adapter for a ``SiglipVisionModel`` (``SiglipVisionConfig``)."""
    return SiglipAdapter(module, **options)
