"""The Qwen2-VL vision tower (``Qwen2VisionTransformerPretrainedModel``, config ``Qwen2VLVisionConfig``).

Full attention in every layer over each frame; 2-D rotary positions; a patch merger. Everything it needs is the
shared Qwen-VL logic (:mod:`encgraph.models.qwen_vl`).
"""

from __future__ import annotations

from typing import Any

import torch

from encgraph.models.qwen_vl import QwenVisionAdapter

__all__ = ["Qwen2VLAdapter", "adapter"]


class Qwen2VLAdapter(QwenVisionAdapter):
    """Adapter of a Qwen2-VL vision tower; see :class:`~encgraph.models.qwen_vl.QwenVisionAdapter`."""

    family = "Qwen2-VL"
    tower_class = "Qwen2VisionTransformerPretrainedModel"


def adapter(module: torch.nn.Module, **options: Any) -> Qwen2VLAdapter:
    """The registry factory: ``options`` are :class:`Qwen2VLAdapter`'s keyword arguments."""
    return Qwen2VLAdapter(module, **options)
