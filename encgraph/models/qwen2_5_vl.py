"""The Qwen2.5-VL vision tower (``Qwen2_5_VisionTransformerPretrainedModel``, config ``Qwen2_5_VLVisionConfig``).

Most layers attend within windows of ``window_size`` pixels (112 px = 4 x 4 merged tokens = 64 patch rows at
patch 14, merge 2); the layers in ``fullatt_block_indexes`` attend over whole frames. The tower reorders its
tokens so that each window is contiguous (``window_index``) and restores the order after the merger
(``argsort(window_index)``, on the device), so outputs come back in the caller's token order.

Static layout: ``window_index`` has one entry per token of the budget (padding tokens map to themselves:
FillRule.ARANGE); ``cu_window_seqlens`` bounds the windows, then padding sequences of at most one window, so the
windowed layers run with ``max_seqlen`` = one window (design rule 3: the budget there made a 4608-token replay
slower than eager).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from encgraph.models.layout import LayoutPatch, align_gated_mlp
from encgraph.models.protocol import BufferSpec, FillRule
from encgraph.models.qwen_grid import UnitGrid, check_window
from encgraph.models.qwen_vl import QwenVisionAdapter

__all__ = ["Qwen25VLAdapter", "adapter", "window_layout"]


def window_layout(units: UnitGrid, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The window permutation and window bounds of a batch, as ``transformers.vision_utils.get_vision_window_index``
    computes them, vectorized over all frames.

    Windows tile each frame's merged grid from the top left in ``window x window`` tokens (smaller at the
    bottom and right edges), frame by frame, row-major; tokens within a window row-major.

    Returns:
        ``window_index``: ``(units,)`` int64; position ``p`` of the windowed order holds token
        ``window_index[p]`` of the caller's order.
        ``cu_window_seqlens``: ``(windows + 1,)`` int64 bounds in patch rows (no empty windows).
    """
    w = window
    frame = units.frame
    height, width = units.height[frame], units.width[frame]
    wy, wx = units.y // w, units.x // w
    tall = np.minimum(w, height - wy * w)  # height of the token's window
    wide = np.minimum(w, width - wx * w)  # width of the token's window
    # Windows above fill whole window rows (w tall, the frame wide); windows to the left are w wide and as tall
    # as this window's row.
    local = wy * w * width + wx * w * tall + (units.y - wy * w) * wide + (units.x - wx * w)
    position = units.start[frame] + local
    window_index = np.empty_like(position)
    window_index[position] = np.arange(position.shape[0])

    rows_w = -(-units.height // w)
    cols_w = -(-units.width // w)
    per_frame = rows_w * cols_w
    owner = np.repeat(np.arange(per_frame.shape[0]), per_frame)
    first = np.zeros(per_frame.shape[0], dtype=np.int64)
    np.cumsum(per_frame[:-1], out=first[1:])
    k = np.arange(owner.shape[0]) - first[owner]
    ky = k // cols_w[owner]
    kx = k - ky * cols_w[owner]
    sizes = np.minimum(w, units.height[owner] - ky * w) * np.minimum(w, units.width[owner] - kx * w)
    bounds = np.concatenate(([0], np.cumsum(sizes * units.merge**2)))
    return window_index, bounds


class Qwen25VLAdapter(QwenVisionAdapter):
    """Adapter of a Qwen2.5-VL vision tower; see :class:`~encgraph.models.qwen_vl.QwenVisionAdapter`.

    Extra buffers per budget ``B`` (``W`` tokens per window side, ``U = merge^2``): ``window_index`` ``(B,)``
    int64 (ARANGE), ``cu_window_seqlens`` int32 (SEQUENCE_BOUNDS in chunks of ``W^2 * U`` rows) with
    ``1 + min(B, B // W + frames) + ceil(B / W^2)`` slots: a frame of ``t`` tokens has at most ``ceil(t / W)``
    windows, and the padding rows need at most ``ceil(B / W^2)`` window-sized sequences.
    """

    family = "Qwen2.5-VL"
    tower_class = "Qwen2_5_VisionTransformerPretrainedModel"

    def _init_family(self, module: torch.nn.Module) -> None:
        self.window = check_window(module.window_size, self.merge, int(module.patch_size))
        self.window_rows = self.window**2 * self.merge**2

    def _layout_rewrites(self, module: torch.nn.Module) -> list[Callable[[], LayoutPatch | None]]:
        # Intermediate size 3420 in every released Qwen2.5-VL tower: misaligned rows (see encgraph.models.layout).
        # Only plain linear projections: a layer another library replaced (a PEFT LoRA layer) runs as it is.
        return super()._layout_rewrites(module) + [
            (lambda block=block: align_gated_mlp(block.mlp)) for block in module.blocks if _plain_gated(block.mlp)
        ]

    def _extra_buffer_specs(self, budget: int, max_frames: int) -> dict[str, BufferSpec]:
        frames = min(max_frames, budget)
        windows = min(budget, budget // self.window + frames)
        padding = -(-budget // self.window**2)
        return {
            "window_index": BufferSpec((budget,), torch.int64, FillRule.ARANGE),
            "cu_window_seqlens": BufferSpec(
                (1 + windows + padding,), torch.int32, FillRule.SEQUENCE_BOUNDS,
                total=self._rows(budget), chunk=self.window_rows,
            ),
        }

    def _frame_tables(self, units: UnitGrid) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        # Single frames: the permutation within each frame (local token indices) and its window sizes in rows.
        window_index, bounds = window_layout(units, self.window)
        tokens = units.height * units.width
        local = window_index - np.repeat(units.start, tokens)
        windows = -(-units.height // self.window) * -(-units.width // self.window)
        return {"window_perm": (local, tokens), "window_rows": (np.diff(bounds), windows)}

    def _assemble(self, frames: list[dict[str, np.ndarray]], cu: np.ndarray) -> dict[str, np.ndarray]:
        unit = self.merge**2
        first_token = cu[:-1] // unit
        perm = np.concatenate([f["window_perm"] for f in frames])
        window_index = perm + np.repeat(first_token, np.diff(cu) // unit)
        sizes = np.concatenate([f["window_rows"] for f in frames])
        bounds = np.zeros(sizes.shape[0] + 1, dtype=np.int64)
        np.cumsum(sizes, out=bounds[1:])
        return {"window_index": window_index, "cu_window_seqlens": bounds}

    def _replay_extras(self, meta: dict[str, np.ndarray]) -> dict[str, Any]:
        return {"cu_window_seqlens": meta.pop("cu_window_seqlens")}

    def _static_kwargs(self, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, Any]:
        return {
            "window_index": buffers["window_index"],
            "cu_window_seqlens": buffers["cu_window_seqlens"],
            "max_window_seqlen": self.window_rows,
        }

    def _eager_extras(self, meta: dict[str, np.ndarray]) -> dict[str, Any]:
        bounds = meta.pop("cu_window_seqlens")
        return {
            "cu_window_seqlens": self._to_device(bounds.astype(np.int32)),
            "max_window_seqlen": int(np.diff(bounds).max()),
        }


def adapter(module: torch.nn.Module, **options: Any) -> Qwen25VLAdapter:
    """The registry factory: ``options`` are :class:`Qwen25VLAdapter`'s keyword arguments."""
    return Qwen25VLAdapter(module, **options)


def _plain_gated(mlp: torch.nn.Module) -> bool:
    return all(type(getattr(mlp, name, None)) is torch.nn.Linear for name in ("gate_proj", "up_proj", "down_proj"))
