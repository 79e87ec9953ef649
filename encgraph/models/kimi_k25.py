"""The Kimi-K2.5 vision tower (``Kimi_K25VisionModel``, config ``Kimi_K25VisionConfig``; transformers'
representative of the Kimi-VL towers, MoonViT).

Where it differs from the Qwen-VL pattern:

- Pixel rows are ``(rows, 3, P, P)`` (one patch each, embedded by a ``Conv2d``), in raster order within a frame;
  rotary positions are raster ``(row, col)`` per patch (no merge-block order).
- The learned ``S x S`` position table is resampled **bicubically** (``align_corners=False``, border padding):
  16 taps per patch (``interp_indices`` / ``interp_weights``), and a video's frame ``f`` adds row ``f + 1`` of a
  sinusoidal time table (``frame_index``; images, ``t == 1``, add row 0, which is zero).
- Attention spans a **whole clip**: one attention sequence per item (``frames=1`` in its spec), all its frames.
- After the layers, a **temporal merge** pools each ``kernel x kernel`` block (2 x 2) by the mean over the
  frames: ``pooler_output`` ``(h*w / 4, 4, hidden)`` per item whatever ``t``. The tower scatters each row with
  ``index_add_`` to ``temporal_merge_index`` (destination, weight ``1 / t``, token count), which it accepts
  precomputed.

So budgets count input units (``t*h*w / 4``: rows / 4), not output tokens. Inside the runner the pooled
tokens of an item occupy the first ``h*w / 4`` of its ``t*h*w / 4`` unit rows and the rest stay zero (the
destination index leaves them out); ``output_for_call`` keeps the first ``h*w / 4`` of each item, so the
graphed tower returns exactly the tower's ``pooler_output``, and ``last_hidden_state`` ``(rows, hidden)`` in
the caller's row order. The forward (transformers 5.24; 5.17's takes another index layout) reads no
``grid_thw`` with all of that given, so the static forward is the tower's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from encgraph.errors import ConfigError, InputError
from encgraph.models.own_forward import own_forward
from encgraph.models._hf import require_transformers
from encgraph.models.protocol import BufferSpec, FillRule
from encgraph.models.qwen_grid import UnitGrid, raster_positions
from encgraph.models.qwen_inputs import QwenVisionInputs
from encgraph.models.qwen_vl import QwenVisionAdapter

__all__ = ["KimiK25Adapter", "adapter", "bicubic_taps", "merge_layout"]

MIN_TRANSFORMERS = "5.24"  # 5.17's tower pools through a (tokens, t, 4) gather index that cannot mix frame counts
TAPS = 16  # bicubic: 4 per axis


def _bicubic_axis(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Taps ``(n, 4)`` int64 and weights ``(n, 4)`` float32 along one axis (Keys kernel ``a = -0.75``,
    ``align_corners=False``, taps clamped to the table), in the float32 operations of transformers'
    ``vision_utils._interpolation_axis_taps_weights``."""
    f32 = np.float32
    src = (index.astype(f32) + f32(0.5)) * f32(side) / size.astype(f32) - f32(0.5)
    floor = np.floor(src)
    offsets = np.arange(-1, 3)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    d = np.abs(src[:, None] - floor[:, None] - offsets.astype(f32))
    a = f32(-0.75)
    near = ((a + f32(2)) * d - (a + f32(3))) * d * d + f32(1)
    far = ((a * d - f32(5) * a) * d + f32(8) * a) * d - f32(4) * a
    return taps, np.where(d <= 1, near, far).astype(f32)


def bicubic_taps(positions: np.ndarray, shape: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Per patch, the 16 rows of the flattened ``side x side`` table and their weights: ``(rows, 16)`` int64
    and float32, for patch ``(row, col)`` ``positions`` in frames of ``(h, w)`` ``shape`` (both ``(rows, 2)``)."""
    h_taps, h_weights = _bicubic_axis(positions[:, 0], shape[:, 0], side)
    w_taps, w_weights = _bicubic_axis(positions[:, 1], shape[:, 1], side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, TAPS)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, TAPS)
    return indices, weights


def merge_layout(grid: np.ndarray, kernel: int) -> dict[str, np.ndarray]:
    """Per patch row of a batch with ``grid`` (``(n, 3)``): ``frame_index`` (row of the time table: 0 for images,
    ``f + 1`` for frame ``f`` of a video), and the temporal merge's ``merge_index`` (destination row
    ``(token * kernel^2 + position in the kernel)``, tokens of item ``j`` counted from its first unit row) and
    ``merge_weight`` (``1 / t``, float32). All ``(rows,)``."""
    t, h, w = grid[:, 0], grid[:, 1], grid[:, 2]
    rows = t * h * w
    item = np.repeat(np.arange(grid.shape[0]), rows)
    first = np.zeros(grid.shape[0], dtype=np.int64)
    np.cumsum(rows[:-1], out=first[1:])
    within = np.arange(item.shape[0]) - first[item]
    frame_rows = (h * w)[item]
    frame = within // frame_rows
    in_frame = within - frame * frame_rows
    row = in_frame // w[item]
    col = in_frame - row * w[item]
    token = (row // kernel) * (w[item] // kernel) + col // kernel
    position = (row % kernel) * kernel + col % kernel
    unit_start = first // kernel**2  # the item's first unit row: its rows / kernel^2 before it
    return {
        "frame_index": np.where(t[item] > 1, frame + 1, 0),
        "merge_index": (unit_start[item] + token) * kernel**2 + position,
        "merge_weight": np.float32(1) / t[item].astype(np.float32),
    }


class KimiK25Adapter(QwenVisionAdapter):
    """Adapter of a Kimi-K2.5 vision tower; see :class:`~encgraph.models.qwen_vl.QwenVisionAdapter` (options
    and shared buffers). Both outputs are always returned.

    Extra buffers per budget (``R`` patch rows): ``interp_indices`` ``(R, 16)`` int64 and ``interp_weights``
    ``(R, 16)`` float32 (ZERO: padding rows get a zero position embedding), ``frame_index`` ``(R,)`` int64 (ZERO),
    ``merge_index`` ``(R,)`` int64 (ARANGE: a padding row pools into its own row, past every real token) and
    ``merge_weight`` ``(R,)`` float32 (ZERO).
    """

    family = "Kimi-K2.5"
    tower_class = "Kimi_K25VisionModel"
    required_attributes = ("patch_embed", "layers", "final_layernorm", "merge_kernel_size")
    call_names = ("pixel_values", "grid_thw")
    flat_rows = False
    clip_attention = True

    def _geometry(self, module: torch.nn.Module) -> tuple[int, torch.Tensor]:
        kernel = tuple(int(k) for k in module.merge_kernel_size)
        if len(kernel) != 2 or kernel[0] != kernel[1]:
            raise ConfigError(f"module: the {self.family} adapter needs a square merge kernel, got {kernel}.")
        return kernel[0], module.patch_embed.proj.weight

    def _init_family(self, module: torch.nn.Module) -> None:
        require_transformers(MIN_TRANSFORMERS, f"the {self.family} adapter")
        config = module.config
        if int(config.pos_emb_height) != int(config.pos_emb_width):
            raise ConfigError(
                f"module: the {self.family} tower resamples a square position table; its config has "
                f"{config.pos_emb_height} x {config.pos_emb_width}."
            )
        self.grid_side = int(config.pos_emb_height)
        self.max_time = int(config.pos_emb_time)
        self.with_last_hidden_state = True

    def _layout_rewrites(self, module: torch.nn.Module) -> list[Any]:
        # The patch embedding also adds the position embedding in its forward: nothing to rewrite there.
        return []

    def compile_regions(self) -> list[torch.nn.Module]:
        """The encoder layers: what ``compile="auto"`` compiles (once for all of them and every budget)."""
        return list(self._module.layers)

    def inputs(self, pixel_values: Any, grid_thw: Any, *, return_dict: bool = True) -> QwenVisionInputs:
        inputs = super().inputs(pixel_values, grid_thw, return_dict=return_dict)
        longest = int(inputs.grid[:, 0].max())
        if longest > self.max_time:
            raise InputError(
                f"grid_thw: the tower's time table holds {self.max_time} frames (pos_emb_time), got an item of "
                f"{longest}; split the video."
            )
        return inputs

    # -- metadata
    def _positions(self, units: UnitGrid) -> np.ndarray:
        return raster_positions(units)

    def _frame_tables(self, units: UnitGrid) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        m = units.merge
        positions = raster_positions(units)
        rows = units.height * units.width * m * m
        shape = np.repeat(np.stack((units.height * m, units.width * m), axis=1), rows, axis=0)
        indices, weights = bicubic_taps(positions, shape, self.grid_side)
        return {"interp_indices": (indices, rows), "interp_weights": (weights, rows)}

    def _assemble(self, frames: list[dict[str, np.ndarray]], cu: np.ndarray) -> dict[str, np.ndarray]:
        return {name: np.concatenate([f[name] for f in frames]) for name in ("interp_indices", "interp_weights")}

    def metadata(self, grid: np.ndarray) -> dict[str, np.ndarray]:
        meta = super().metadata(grid)
        meta.update(merge_layout(grid, self.merge))
        return meta

    def _extra_buffer_specs(self, budget: int, max_frames: int) -> dict[str, BufferSpec]:
        rows = self._rows(budget)
        return {
            "interp_indices": BufferSpec((rows, TAPS), torch.int64, FillRule.ZERO),
            "interp_weights": BufferSpec((rows, TAPS), torch.float32, FillRule.ZERO),
            "frame_index": BufferSpec((rows,), torch.int64, FillRule.ZERO),
            "merge_index": BufferSpec((rows,), torch.int64, FillRule.ARANGE),
            "merge_weight": BufferSpec((rows,), torch.float32, FillRule.ZERO),
        }

    def _static_kwargs(self, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, Any]:
        return {
            "interp_indices": buffers["interp_indices"],
            "interp_weights": buffers["interp_weights"],
            "frame_index": buffers["frame_index"],
            "temporal_merge_index": (buffers["merge_index"], buffers["merge_weight"], budget),
        }

    def _eager_extras(self, meta: dict[str, np.ndarray]) -> dict[str, Any]:
        index = meta.pop("merge_index")
        weight = meta.pop("merge_weight")
        units = index.shape[0] // self.merge**2
        return {"temporal_merge_index": (self._to_device(index), self._to_device(weight), units)}

    # -- forwards and results
    def _run(self, pixels: torch.Tensor, tokens: int, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            out = own_forward(self._module)(pixels, grid_thw=None, return_dict=True, **kwargs)
        return {
            "pooler_output": out.pooler_output,  # (tokens, kernel^2, hidden): an item's first h*w/4 are real
            "last_hidden_state": out.last_hidden_state.reshape(tokens, -1),
        }

    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One item's outputs: ``last_hidden_state`` ``(t*h*w/4, 4 * hidden)`` (its rows, four per unit) and
        ``pooler_output`` ``(t*h*w/4, 4, hidden)`` whose first ``h*w/4`` rows are the pooled tokens (the rest
        zero; :meth:`output_for_call` drops them)."""
        return dict(parts["default"])

    def output_for_call(self, results: Sequence[Mapping[str, torch.Tensor]], inputs: QwenVisionInputs) -> Any:
        """``BaseModelOutputWithPooling``: ``last_hidden_state`` ``(rows, hidden)`` and ``pooler_output``
        ``(sum h*w/4, 4, hidden)``, items in order (or its ``to_tuple()`` for ``return_dict=False``)."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        grid = self._coerce(inputs).grid
        keep = (grid[:, 1] * grid[:, 2] // self.merge**2).tolist()
        pooled = torch.cat([r["pooler_output"][:k] for r, k in zip(results, keep)])
        last = torch.cat([r["last_hidden_state"] for r in results]).reshape(-1, self.hidden)
        out = BaseModelOutputWithPooling(last_hidden_state=last, pooler_output=pooled)
        return out if inputs.return_dict else out.to_tuple()


def adapter(module: torch.nn.Module, **options: Any) -> KimiK25Adapter:
    """The registry factory: ``options`` are :class:`KimiK25Adapter`'s keyword arguments."""
    return KimiK25Adapter(module, **options)
