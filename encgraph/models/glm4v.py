"""The GLM-4V vision tower (``Glm4vVisionModel``, config ``Glm4vVisionConfig``: GLM-4.1V and GLM-4.6V; the
identical ``Glm4vMoeVisionModel`` of GLM-4.5V, config ``Glm4vMoeVisionConfig``).

The Qwen-VL pattern (patch rows in merge-block order, 2-D rotary positions, full attention per frame) with two
differences:

- **Position embedding.** Each patch adds a learned ``S x S`` table resampled by ``F.grid_sample`` (bicubic) at
  its coordinates normalised by its frame's ``(h, w)``; the tower finds the frame of each row on the device from
  ``cu_seqlens`` and reads that frame's shape from ``grid_thw[frame]``. So ``grid_thw`` is not metadata the
  tower can skip but a device tensor indexed per attention sequence: the static forward passes a per-frame grid
  buffer (``grid_thw``, ``(frames + 1, 3)`` int64): row ``k`` is ``(1, h, w)`` of sequence ``k``, the rows past
  the frames zero, read through ``clamp(min=1)`` (one small device op): the padding sequence's rows, at
  coordinate 0, get a finite embedding of a 1 x 1 grid, also in the all-padding batch of the capture. The
  resampling runs as one weighted gather of the table's rows (:mod:`encgraph.models.bicubic`, a layout rewrite):
  ``grid_sample`` walks the channels one point per thread and took 3.15 of the 5.13 kernel ms of a 224 px image.
- **Outputs.** After the layers a ``merge x merge`` convolution downsamples to one row per token:
  ``last_hidden_state`` is ``(tokens, out_hidden)``, ``pooler_output`` the merger's ``(tokens, out_hidden)``;
  both come back, in ``BaseModelOutputWithPooling``.

Videos: the model flattens a video's ``(t, h, w)`` into ``t`` rows ``(1, h, w)`` before calling the tower
(``Glm4vModel.get_video_features``), and the tower itself cannot take ``t > 1`` (its frame lookup would read
the next item's shape, or past the end). The adapter takes either: a row ``(t, h, w)`` is one item of ``t``
frames, each attending on its own, exactly as the model's flattened call computes it (and packed as one item).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from encgraph.models.bicubic import position_embedding_gather
from encgraph.models.layout import LayoutPatch
from encgraph.models.protocol import BufferSpec, FillRule
from encgraph.models.qwen_grid import UnitGrid
from encgraph.models.qwen_vl import QwenVisionAdapter

__all__ = ["Glm4vAdapter", "adapter"]

class Glm4vAdapter(QwenVisionAdapter):
    """Adapter of a GLM-4V vision tower; see :class:`~encgraph.models.qwen_vl.QwenVisionAdapter` (options and
    the shared buffers). ``last_hidden_state`` is always returned (one row per token, as ``pooler_output``).

    Extra buffer per budget: ``grid_thw`` ``(min(max_frames, budget) + 1, 3)`` int64: the frames' ``(1, h, w)``,
    then ZERO (read as 1: see the module notes).
    """

    family = "GLM-4V"
    tower_class = "Glm4vVisionModel"
    required_attributes = ("patch_embed", "embeddings", "blocks", "downsample", "merger", "spatial_merge_size")

    def _layout_rewrites(self, module: torch.nn.Module) -> list[Callable[[], LayoutPatch | None]]:
        # The position table's bicubic grid_sample is most of a small image's kernel time (encgraph.models.bicubic).
        return super()._layout_rewrites(module) + [lambda: position_embedding_gather(module.embeddings)]

    def _init_family(self, module: torch.nn.Module) -> None:
        self.with_last_hidden_state = True  # per token after the downsample: as cheap as pooler_output
        self.hidden = int(module.config.out_hidden_size)

    def _extra_buffer_specs(self, budget: int, max_frames: int) -> dict[str, BufferSpec]:
        return {"grid_thw": BufferSpec((min(max_frames, budget) + 1, 3), torch.int64, FillRule.ZERO)}

    def _frame_tables(self, units: UnitGrid) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        m = self.merge
        shapes = np.stack((np.ones_like(units.height), units.height * m, units.width * m), axis=1)
        return {"grid_thw": (shapes, np.ones_like(units.height))}

    def _assemble(self, frames: list[dict[str, np.ndarray]], cu: np.ndarray) -> dict[str, np.ndarray]:
        return {"grid_thw": np.concatenate([f["grid_thw"] for f in frames])}

    def _static_kwargs(self, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, Any]:
        return {"grid_thw": buffers["grid_thw"].clamp(min=1)}


def adapter(module: torch.nn.Module, **options: Any) -> Glm4vAdapter:
    """The registry factory: ``options`` are :class:`Glm4vAdapter`'s keyword arguments."""
    return Glm4vAdapter(module, **options)
