"""The HunYuan-VL vision tower (``HunYuanVLVisionTransformer``, config ``HunYuanVLVisionConfig``; HunyuanOCR's).

A NaViT SigLIP with its connector inside: pixel rows ``(rows, C*P*P)`` with ``grid_thw`` (images only, ``t = 1``),
in raster order within an image; a learned square position table (``max_image_size / patch`` a side, after a
class row it never reads) resampled to each image's grid (bilinear, ``align_corners=False``); full attention per
image; then a merger: RMSNorm, a ``merge x merge`` stride-``merge`` convolution, a 1 x 1 one, a learned separator
token after each row of merged tokens, a linear projection to the text width, learned begin and end tokens around
the image, RMSNorm. An image of ``h x w`` patches gives ``(h/m) * (w/m + 1) + 2`` rows of ``pooler_output``
(``(1, rows, text_hidden)``, all images in order) and ``h*w`` rows of ``last_hidden_state`` (``(1, rows, hidden)``).

The tower's forward reads ``grid_thw`` in Python loops (position tables and the merger, per image) and takes no
precomputed metadata, so the static forward is the adapter's own, out of the tower's modules: the patch embedding,
the position embedding from host taps (``interp_indices`` / ``interp_weights``,
:func:`encgraph.models.qwen3_vl.interpolation`, bit for bit as transformers' helper, in raster order), the layers
with packed ``cu_seqlens`` (one sequence per image), and the merger over the whole batch through three host-made
gathers (:func:`merger_layout`): each merged token's ``m x m`` patch rows, the row separators, and begin / end.

Budgets count merge units (``h*w / m^2``: the merged tokens, before the separators and begin / end; the rows are
``m^2`` per unit). Inside the runner an image's ``pooler_output`` rows take the first of its ``m^2`` rows per unit
(they always fit) and the rest are zero; ``output_for_call`` keeps each image's own, so the graphed tower returns
the tower's fields (to float rounding: the merger's convolution runs over the batch's blocks, not image by image,
and the table is resampled as a weighted sum of taps). The default ladder, 256 to 4096 units, spans the processor's defaults (a 512 px image
to a 2048 px one at patch 16). An image whose ``h`` or ``w`` is not a multiple of the merge (the processor makes
none; the tower's merger drops the odd row or column) is left to the tower's own forward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from encgraph.errors import ConfigError, InputError
from encgraph.models.layout import linear_patch_embed
from encgraph.models.protocol import BufferSpec, FillRule, StockCall
from encgraph.models.qwen3_vl import InterpolatedPositions
from encgraph.models.qwen_grid import UnitGrid, grid_array
from encgraph.models.qwen_inputs import QwenVisionInputs
from encgraph.models.qwen_vl import QwenVisionAdapter

__all__ = ["HunYuanVLAdapter", "UnmergedGrid", "adapter", "merger_layout", "pooled_rows"]

LAYOUT = ("merge_index", "slot_index", "pooler_index")
"""The merger's gather indices, host-made per batch (:func:`merger_layout`)."""
SLOTS_PER_UNIT = 2
"""Rows before the text projection per unit: an image's ``(h/m) * (w/m + 1)`` merged tokens and separators fit
in two per unit (``h/m <= h*w / m^2``)."""
ZERO, BEGIN, END, FIRST_SLOT = 0, 1, 2, 3
"""Rows of the final gather's source: a zero row (an image's spare rows), begin, end, then the projected slots."""


class UnmergedGrid(InputError):
    """An image whose ``h`` or ``w`` is not a multiple of the merge: the tower's merger drops its last row or
    column of patches, which the graphs do not model; ``graphed(tower)`` leaves such a call to the tower."""


def pooled_rows(grid: np.ndarray, merge: int) -> np.ndarray:
    """``pooler_output`` rows per image of ``grid`` (``(n, 3)``): ``(h/m) * (w/m + 1) + 2``."""
    return (grid[:, 1] // merge) * (grid[:, 2] // merge + 1) + 2


def merger_layout(grid: np.ndarray, merge: int) -> dict[str, np.ndarray]:
    """The merger's gathers for a batch of images ``grid`` (``(n, 3)``, ``t = 1``, ``h``, ``w`` multiples of
    ``merge``), unit ``u`` of image ``j`` counted from the image's first unit ``U_j``:

    - ``merge_index`` ``(rows,)``: per unit (raster over the merged grid) its ``m x m`` patch rows, row-major,
      as the convolution reads them;
    - ``slot_index`` ``(2 * units,)``: the rows of ``cat([separator, merged tokens])`` the text projection takes:
      image ``j``'s ``2 * units_j`` slots from ``2 * U_j`` are its merged tokens row by row, each row followed by
      the separator (row 0), then spare slots (the separator again);
    - ``pooler_index`` ``(rows,)``: the rows of ``cat([zero, begin, end, projected slots])`` the output takes:
      image ``j``'s ``m^2 * units_j`` rows are begin, its projected slots, end, then zero rows.
    """
    m, n = merge, grid.shape[0]
    h, w = grid[:, 1] // m, grid[:, 2] // m
    units = h * w
    first = np.zeros(n, dtype=np.int64)
    np.cumsum(units[:-1], out=first[1:])

    def owner(per_item: np.ndarray, scale: int) -> tuple[np.ndarray, np.ndarray]:
        """Per position of the items' ``scale * units`` runs: its item and its index within the item's run."""
        item = np.repeat(np.arange(n), per_item)
        return item, np.arange(item.shape[0]) - scale * first[item]

    item, within = owner(units, 1)
    y, x = within // w[item], within % w[item]
    cols = w[item] * m  # the image's width in patches
    kh, kw = np.divmod(np.arange(m * m), m)
    merge_index = ((first[item] * m * m + y * m * cols + x * m)[:, None] + kh * cols[:, None] + kw).reshape(-1)

    item, s = owner(SLOTS_PER_UNIT * units, SLOTS_PER_UNIT)
    line = w[item] + 1
    r, c = s // line, s % line
    real = (r < h[item]) & (c < w[item])
    slot_index = np.where(real, 1 + first[item] + r * w[item] + c, 0)

    item, q = owner(m * m * units, m * m)
    length = (h * (w + 1))[item]
    slot = FIRST_SLOT + SLOTS_PER_UNIT * first[item] + q - 1
    pooler_index = np.where(q == 0, BEGIN, np.where(q <= length, slot, np.where(q == length + 1, END, ZERO)))
    return {"merge_index": merge_index, "slot_index": slot_index, "pooler_index": pooler_index}


class HunYuanVLAdapter(InterpolatedPositions, QwenVisionAdapter):
    """Adapter of a HunYuan-VL vision tower; see :class:`~encgraph.models.qwen_vl.QwenVisionAdapter` (options and
    shared buffers; budgets here count merge units, default 256..4096). Both outputs are always returned.

    Extra buffers per budget ``B`` (``R = m^2 * B`` patch rows): :class:`~encgraph.models.qwen3_vl.
    InterpolatedPositions`'s, ``merge_index`` ``(R,)`` (ARANGE: padding units merge padding rows),
    ``slot_index`` ``(2B,)`` and ``pooler_index`` ``(R,)`` (ZERO: the separator, the zero row), all int64. No
    ``position_ids``: the tower has no rotary embedding.
    """

    family = "HunYuan-VL"
    tower_class = "HunYuanVLVisionTransformer"
    required_attributes = ("embeddings", "layers", "patch_merger")
    call_names = ("pixel_values", "grid_thw")
    raster_rows = True
    default_budgets = (256, 4096)  # 2 x 2 patch units

    def _geometry(self, module: torch.nn.Module) -> tuple[int, torch.Tensor]:
        return int(module.config.spatial_merge_size), module.embeddings.patch_embedding.weight

    def _init_family(self, module: torch.nn.Module) -> None:
        embeddings, merger = module.embeddings, module.patch_merger
        mode = getattr(module.config, "interpolate_mode", "bilinear")
        if mode != "bilinear":
            raise ConfigError(f"module: the {self.family} adapter reproduces bilinear interpolation, the tower uses "
                              f"{mode!r}.")
        conv = merger.proj_conv
        if self.merge < 2 or tuple(conv.kernel_size) != (self.merge,) * 2 or tuple(conv.stride) != (self.merge,) * 2:
            raise ConfigError(
                f"module: the {self.family} adapter needs the merger's convolution to take {self.merge} x "
                f"{self.merge} blocks (spatial_merge_size >= 2), got kernel {conv.kernel_size}, stride {conv.stride}."
            )
        self.grid_side = int(embeddings.position_edge)
        self.align_corners = False  # interpolate_pos_encoding's (transformers 5.15 to 5.25)
        self.with_last_hidden_state = True

    def _layout_rewrites(self, module: torch.nn.Module) -> list[Any]:
        # The stride-P patch convolution as one matmul over the flat rows (the embeddings' forward, while engaged).
        return [lambda: linear_patch_embed(module.embeddings, proj="patch_embedding")]

    def compile_regions(self) -> list[torch.nn.Module]:
        """The encoder layers: what ``compile="auto"`` compiles (once for all of them and every budget)."""
        return list(self._module.layers)

    @property
    def output_names(self) -> tuple[str, ...]:
        return ("last_hidden_state", "pooler_output")  # the tower's field order

    def inputs(self, pixel_values: Any, grid_thw: Any, *, return_dict: bool = True) -> QwenVisionInputs:
        """As the base's; items must be images (``t = 1``: the tower's merger reshapes an item to one frame) of
        ``h`` and ``w`` multiples of the merge (else :class:`UnmergedGrid`)."""
        grid = grid_array(grid_thw)  # a device tensor is copied to the host once, here
        odd = np.nonzero((grid[:, 1:] % self.merge).any(axis=1))[0]
        if odd.size:
            raise UnmergedGrid(
                f"grid_thw: h and w must be multiples of the spatial merge size {self.merge} for the graphs; item "
                f"{int(odd[0])} has {grid[odd[0]].tolist()} (the tower's merger drops its last row or column of "
                "patches; graphed(tower) leaves such a call to the tower)."
            )
        inputs = super().inputs(pixel_values, grid, return_dict=return_dict)
        videos = np.nonzero(inputs.grid[:, 0] != 1)[0]
        if videos.size:
            raise InputError(f"grid_thw: the {self.family} tower takes images only (t = 1); item {int(videos[0])} "
                             f"has {inputs.grid[videos[0]].tolist()}.")
        return inputs

    def inputs_from_call(self, *args: Any, **kwargs: Any) -> QwenVisionInputs | StockCall:
        """As the base's; a call with an image the merger cannot take whole is the tower's own (counted)."""
        try:
            return super().inputs_from_call(*args, **kwargs)
        except UnmergedGrid:
            return StockCall("h or w not a multiple of the merge size")

    # -- metadata and buffers
    def _positions(self, units: UnitGrid) -> np.ndarray:
        return np.empty((units.units * self.merge**2, 0), dtype=np.int64)  # no rotary positions in this tower

    def metadata(self, grid: np.ndarray) -> dict[str, np.ndarray]:
        meta = super().metadata(grid)
        del meta["position_ids"]
        meta.update(merger_layout(grid, self.merge))
        return meta

    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> dict[str, BufferSpec]:
        specs = super().buffer_specs(path, budget, max_items, max_frames)
        del specs["position_ids"]
        return specs

    def _extra_buffer_specs(self, budget: int, max_frames: int) -> dict[str, BufferSpec]:
        rows = self._rows(budget)
        specs = super()._extra_buffer_specs(budget, max_frames)
        specs["merge_index"] = BufferSpec((rows,), torch.int64, FillRule.ARANGE)
        specs["slot_index"] = BufferSpec((SLOTS_PER_UNIT * budget,), torch.int64, FillRule.ZERO)
        specs["pooler_index"] = BufferSpec((rows,), torch.int64, FillRule.ZERO)
        return specs

    def _static_kwargs(self, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, Any]:
        kwargs = super()._static_kwargs(buffers, budget)
        kwargs.update((name, buffers[name]) for name in LAYOUT)
        return kwargs

    # -- forwards
    def forward_static(self, path: str, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
        kwargs = {"cu_seqlens": buffers["cu_seqlens"], "max_seqlen": self._rows(budget)}
        kwargs.update(self._static_kwargs(buffers, budget))
        with self._engaged():
            return self._run(buffers["pixels"], budget, kwargs)

    def _run(self, pixels: torch.Tensor, tokens: int, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The tower's computation over a packed batch of ``tokens`` units (``pixels``: their rows), its metadata
        in ``kwargs``: ``last_hidden_state`` ``(tokens, m^2 * hidden)``, ``pooler_output`` ``(tokens, m^2,
        text_hidden)`` (an image's rows first, then zero rows)."""
        with torch.no_grad():
            hidden = self._embed(pixels, kwargs["interp_indices"], kwargs["interp_weights"]).unsqueeze(0)
            for layer in self._module.layers:
                hidden = layer(hidden, cu_seqlens=kwargs["cu_seqlens"], max_seqlen=kwargs["max_seqlen"],
                               attention_mask=None)
            pooled = self._merge(hidden[0], tokens, kwargs)
        return {"last_hidden_state": hidden.reshape(tokens, -1), "pooler_output": pooled.reshape(tokens, self.merge**2, -1)}

    def _embed(self, pixels: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Patch embeddings plus the resampled position table: ``interpolate_pos_encoding``'s float32 values, as
        the taps' weighted sum."""
        embeddings = self._module.embeddings
        if any(not patch.restored for patch in self._layout):  # the linear patch embedding, engaged
            x = embeddings(pixels)
        else:
            conv = embeddings.patch_embedding
            x = conv(pixels.reshape(-1, *self.patch_shape).to(conv.weight.dtype)).flatten(1)
        # Gathered, then cast: the same values as the tower's float32 table, without casting all of it.
        table = embeddings.position_embedding.weight[1:]
        positions = (F.embedding(indices, table).float() * weights[:, :, None]).sum(1)
        return x + positions.to(x.dtype)

    def _merge(self, hidden: torch.Tensor, tokens: int, kwargs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The tower's ``patch_merger`` over every image of the batch at once, ``(m^2 * tokens, text_hidden)``."""
        merger, m = self._module.patch_merger, self.merge
        x = merger.before_rms(hidden)
        dtype = x.dtype
        blocks = x[kwargs["merge_index"]].view(tokens, m, m, -1).permute(0, 3, 1, 2)  # (units, hidden, m, m)
        merged = merger.proj_out(merger.proj_act(merger.proj_conv(blocks))).flatten(1)
        separator = merger.image_newline.to(dtype).reshape(1, -1)
        slots = merger.mlp(torch.cat([separator, merged])[kwargs["slot_index"]])
        ends = [merger.image_begin.to(dtype).reshape(1, -1), merger.image_end.to(dtype).reshape(1, -1)]
        rows = torch.cat([slots.new_zeros(1, slots.shape[1]), *ends, slots])[kwargs["pooler_index"]]
        return merger.after_rms(rows)

    # -- results
    def output_for_call(self, results: Sequence[Mapping[str, torch.Tensor]], inputs: QwenVisionInputs) -> Any:
        """``BaseModelOutputWithPooling`` as the tower returns it: ``last_hidden_state`` ``(1, rows, hidden)`` and
        ``pooler_output`` ``(1, sum of pooled rows, text_hidden)``, images in order (or its ``to_tuple()`` for
        ``return_dict=False``)."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        inputs = self._coerce(inputs)
        keep = pooled_rows(inputs.grid, self.merge).tolist()
        pooled = torch.cat([r["pooler_output"].flatten(0, 1)[:k] for r, k in zip(results, keep)])
        last = torch.cat([r["last_hidden_state"] for r in results]).reshape(1, -1, self.hidden)
        out = BaseModelOutputWithPooling(last_hidden_state=last, pooler_output=pooled.unsqueeze(0))
        return out if inputs.return_dict else out.to_tuple()


def adapter(module: torch.nn.Module, **options: Any) -> HunYuanVLAdapter:
    """The registry factory: ``options`` are :class:`HunYuanVLAdapter`'s keyword arguments."""
    return HunYuanVLAdapter(module, **options)
