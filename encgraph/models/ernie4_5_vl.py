"""The ERNIE-4.5-VL vision tower (``Ernie4_5_VLMoeVisionTransformerPretrainedModel``, config
``Ernie4_5_VLMoeVisionConfig``).

The Qwen-VL pattern without a merger: patch rows ``(rows, C*P*P)`` (no temporal patch: a video's frames are
rows of their own) in merge-block order, embedded by one linear layer, 2-D rotary positions, full attention per
frame, a final LayerNorm. The model's resampler (outside the tower) merges each ``merge x merge`` unit and pairs
of frames. The tower's forward takes ``position_ids``, ``cu_seqlens`` and ``max_seqlen`` precomputed and then
never reads ``grid_thw`` (transformers 5.17 and 5.24), so the static forward is the tower's own.

Output: ``BaseModelOutputWithPooling`` with ``last_hidden_state`` ``(rows, hidden)`` in the caller's row order
and ``pooler_output`` ``None``, as the tower returns it. Budgets count ``merge x merge`` units (what the
resampler makes one token of); inside the runner an item's rows travel as ``(units, merge^2 * hidden)``.
"""

from __future__ import annotations

from typing import Any

import torch

from encgraph.models.own_forward import own_forward
from encgraph.models.qwen_vl import QwenVisionAdapter

__all__ = ["Ernie45VLAdapter", "adapter"]


class Ernie45VLAdapter(QwenVisionAdapter):
    """Adapter of an ERNIE-4.5-VL vision tower; see :class:`~encgraph.models.qwen_vl.QwenVisionAdapter` (options
    and buffers). The one output, ``last_hidden_state``, is always returned."""

    family = "ERNIE-4.5-VL"
    tower_class = "Ernie4_5_VLMoeVisionTransformerPretrainedModel"
    required_attributes = ("patch_embed", "blocks", "ln", "spatial_merge_size")

    def _init_family(self, module: torch.nn.Module) -> None:
        self.with_last_hidden_state = True

    @property
    def output_names(self) -> tuple[str, ...]:
        return ("last_hidden_state",)

    def _run(self, pixels: torch.Tensor, tokens: int, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            out = own_forward(self._module)(pixels, grid_thw=None, return_dict=True, **kwargs)
        return {"last_hidden_state": out.last_hidden_state.reshape(tokens, -1)}

    def _output(self, last: torch.Tensor | None, cat: dict[str, torch.Tensor]) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        return BaseModelOutputWithPooling(last_hidden_state=last)


def adapter(module: torch.nn.Module, **options: Any) -> Ernie45VLAdapter:
    """The registry factory: ``options`` are :class:`Ernie45VLAdapter`'s keyword arguments."""
    return Ernie45VLAdapter(module, **options)
