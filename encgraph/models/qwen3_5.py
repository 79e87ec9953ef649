"""The Qwen3.5 vision tower (``Qwen3_5VisionModel``, config ``Qwen3_5VisionConfig``; the identical
``Qwen3_5MoeVisionModel`` of Qwen3.5-MoE too).

The Qwen3-VL tower without deepstack: 2-D rotary positions, a learned position grid resampled bilinearly to each
item (``interp_indices`` / ``interp_weights``, computed on the host exactly as for Qwen3-VL), full attention per
frame, one patch merger. Its forward (transformers 5.17 and 5.24) takes every piece of metadata precomputed and
then never reads ``grid_thw``, so the static forward is the tower's own. It returns
``BaseModelOutputWithPooling``: ``last_hidden_state`` ``(rows, hidden)`` before the merger, in the caller's row
order, and ``pooler_output`` ``(tokens, out_hidden)``; both come back.
"""

from __future__ import annotations

from typing import Any

import torch

from encgraph.models.qwen3_vl import Qwen3VLAdapter
from encgraph.models.qwen_vl import QwenVisionAdapter

__all__ = ["Qwen35VLAdapter", "adapter"]


class Qwen35VLAdapter(Qwen3VLAdapter):
    """Adapter of a Qwen3.5 vision tower; see :class:`~encgraph.models.qwen3_vl.Qwen3VLAdapter` (buffers) and
    :class:`~encgraph.models.qwen_vl.QwenVisionAdapter` (options). ``last_hidden_state`` is always returned."""

    family = "Qwen3.5"
    tower_class = "Qwen3_5VisionModel"

    def _init_family(self, module: torch.nn.Module) -> None:
        super()._init_family(module)
        self.with_last_hidden_state = True  # the tower returns it: so does the adapter

    # No deepstack: the plain Qwen-VL outputs and output type.
    _extra_named = QwenVisionAdapter._extra_named
    _output = QwenVisionAdapter._output


def adapter(module: torch.nn.Module, **options: Any) -> Qwen35VLAdapter:
    """The registry factory: ``options`` are :class:`Qwen35VLAdapter`'s keyword arguments."""
    return Qwen35VLAdapter(module, **options)
