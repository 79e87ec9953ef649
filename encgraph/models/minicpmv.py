"""The MiniCPM-V 4.6 vision tower (``MiniCPMV4_6VisionModel``, config ``MiniCPMV4_6VisionConfig``; the identical
towers of MiniCPM-V 4.7 and MiniCPM-OCR too): a NaViT-packed SigLIP with a window-attention merger inside.

Inputs: ``pixel_values`` ``(1, C, P, L*P)``, one strip of ``L`` patches (each image's ``h x w`` patches in raster
order, images one after the other), and ``target_sizes`` ``(n, 2)``, each image's ``(h, w)`` in patches (a video
reaches the tower as its frames, one image each: ``get_video_features`` repacks it). The adapter holds the strip
as patch rows ``(L, C, P, P)`` (a view) and describes image ``i`` as grid ``(1, h, w)``.

The layers attend per image; after layer ``insert_layer_id`` the ``vit_merger`` attends within 2 x 2 windows
(``window_index`` groups each window's 4 rows) and turns each window into one token, so the later layers and
the output run on ``h*w / 4`` tokens per image: budgets count those. The tower's forward cannot be captured as it
is: the merger formats ``target_sizes`` into an error message on every call (a host read of a device tensor), and
the layers after it rebuild ``cu_seqlens`` from ``target_sizes``. So the static forward is the adapter's own, out
of the tower's submodules (the same weights, no copies): patch embedding as one matmul, position embedding by
host-computed nearest-bucket ids (``get_vision_nearest_position_ids``), the encoder layers with packed
attention, the merger's attention and MLP, the final LayerNorm. The per-image ``MiniCPMV4_6Merger`` of the
model stays outside the tower, and so outside the graph.

Output: ``BaseModelOutputWithPooling`` with ``last_hidden_state`` ``(1, tokens, hidden)`` (``pooler_output``
``None``), as the tower returns it. ``use_vit_merger=False`` (the model's "4x" mode) is answered by the
tower's own forward (:class:`~encgraph.models.protocol.StockCall`), as are per-layer outputs.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from encgraph._validate import describe
from encgraph.errors import ConfigError, InputError, InputTypeError
from encgraph.models._hf import require_transformers
from encgraph.models.protocol import BufferSpec, FillRule, StockCall
from encgraph.models.qwen2_5_vl import window_layout
from encgraph.models.qwen_grid import UnitGrid, grid_array, raster_positions, unit_grid
from encgraph.models.qwen_inputs import RECORDING_SWITCHES, QwenVisionInputs
from encgraph.models.qwen_vl import QwenVisionAdapter

__all__ = ["MiniCPMVAdapter", "adapter", "nearest_positions"]

MIN_TRANSFORMERS = "5.24"  # 5.17's merger assumes every image of a call has the same size
WINDOW = 2  # the merger's window side, in patches (the tower halves target_sizes after it: it must be 2)


def nearest_positions(units: UnitGrid, boundaries: np.ndarray, side: int) -> np.ndarray:
    """Per patch of the frames of ``units`` (raster order), its row of the flattened ``side x side`` position
    table: the bucket among ``boundaries`` (float32) of ``row / h`` and of ``col / w``, as
    ``transformers.vision_utils.get_vision_nearest_position_ids`` computes them (``(rows,)`` int64)."""
    positions = raster_positions(units)
    m = units.merge
    frame = np.repeat(np.arange(units.height.shape[0]), units.height * units.width * m * m)
    shape = np.stack((units.height * m, units.width * m), axis=1)[frame].astype(np.float32)
    buckets = np.searchsorted(boundaries, positions.astype(np.float32) / shape, side="right")
    return (buckets[:, 0] * side + buckets[:, 1]).astype(np.int64)


class MiniCPMVAdapter(QwenVisionAdapter):
    """Adapter of a MiniCPM-V 4.6 vision tower; see :class:`~encgraph.models.qwen_vl.QwenVisionAdapter` for the
    options (``last_hidden_state`` and ``fast_layout`` do not apply: the one output is ``last_hidden_state``, and
    the static forward embeds patches with one matmul anyway).

    Buffers per budget ``B`` (``R = 4B`` patch rows with the merger, ``B`` without): ``pixels`` ``(R, C, P, P)``,
    ``position_ids`` ``(R,)`` int64 (ZERO), ``cu_seqlens`` (SEQUENCE_BOUNDS over ``R`` rows), and with the
    merger ``window_index`` ``(R,)`` int64 (ARANGE) and ``cu_merged`` (SEQUENCE_BOUNDS over ``B`` tokens).
    """

    family = "MiniCPM-V 4.6"
    tower_class = "MiniCPMV4_6VisionModel"
    required_attributes = ("embeddings", "encoder", "vit_merger", "post_layernorm")
    call_names = ("pixel_values", "target_sizes")
    flat_rows = False

    def _geometry(self, module: torch.nn.Module) -> tuple[int, torch.Tensor]:
        require_transformers(MIN_TRANSFORMERS, f"the {self.family} adapter")
        config = module.config
        self.insert_layer = int(config.insert_layer_id)
        self.merges = 0 <= self.insert_layer < len(module.encoder.layers)
        if self.merges and tuple(config.window_kernel_size) != (WINDOW, WINDOW):
            raise ConfigError(
                f"module: the {self.family} tower halves target_sizes after its merger, so its window must be "
                f"{WINDOW} x {WINDOW}; the config has {tuple(config.window_kernel_size)}."
            )
        return (WINDOW if self.merges else 1), module.embeddings.patch_embedding.weight

    def _init_family(self, module: torch.nn.Module) -> None:
        self.with_last_hidden_state = True
        side = int(module.embeddings.num_patches_per_side)
        self.table_side = side
        # The tower's bucket boundaries, as it computes them (float32 arange with a float step).
        self.boundaries = torch.arange(1 / side, 1.0, 1 / side).numpy()

    def _layout_rewrites(self, module: torch.nn.Module) -> list[Any]:
        return []  # the adapter's own forward embeds the patches as one matmul

    @property
    def output_names(self) -> tuple[str, ...]:
        return ("last_hidden_state",)

    def compile_regions(self) -> list[torch.nn.Module]:
        """The encoder layers (before and after the merger: one trace, a symbolic row count) for
        ``compile="auto"``; the merger and the embeddings run as they are."""
        return list(self._module.encoder.layers)

    # -- inputs
    def inputs(self, pixel_values: Any, target_sizes: Any, *, return_dict: bool = True) -> QwenVisionInputs:
        """Validate the tower's ``(pixel_values (1, C, P, L*P), target_sizes (n, 2))`` into inputs whose pixel rows
        are the strip's patches ``(L, C, P, P)`` (a view) and whose grid is ``(1, h, w)`` per image."""
        c, p, q = self.patch_shape
        hint = f"(1, {c}, {p}, patches * {q})"
        if not isinstance(pixel_values, torch.Tensor):
            raise InputTypeError(f"pixel_values: expected a torch.Tensor {hint}, got {describe(pixel_values)}.")
        shape = tuple(pixel_values.shape)
        if len(shape) != 4 or shape[0] != 1 or shape[1:3] != (c, p) or shape[3] % q:
            raise InputError(
                f"pixel_values: expected the processor's packed strip {hint}, got {shape}; pass pixel_values[:1] "
                "as the model does."
            )
        sizes = grid_array(target_sizes, "target_sizes", "h, w")
        if sizes.min() < 1:
            raise InputError(f"target_sizes: every h, w must be >= 1, got {sizes.tolist()}.")
        odd = np.nonzero((sizes % self.merge).any(axis=1))[0]
        if odd.size:
            raise InputError(
                f"target_sizes: h and w must be multiples of the merger's window {self.merge}; image {int(odd[0])} "
                f"is {sizes[odd[0]].tolist()}."
            )
        patches = shape[3] // q
        if int(sizes.prod(1).sum()) != patches:
            raise InputError(
                f"pixel_values: target_sizes needs sum(h*w) = {int(sizes.prod(1).sum())} patches, the strip has "
                f"{patches}; pixel_values and target_sizes must describe the same images."
            )
        rows = pixel_values[0].unflatten(2, (patches, q)).permute(2, 0, 1, 3)
        grid = np.concatenate((np.ones((sizes.shape[0], 1), dtype=np.int64), sizes), axis=1)
        return super().inputs(rows, grid, return_dict=return_dict)

    def inputs_from_call(self, *args: Any, **kwargs: Any) -> QwenVisionInputs | StockCall:
        """The tower's ``forward(pixel_values, target_sizes, use_vit_merger=True, **kwargs)`` as inputs.

        ``use_vit_merger=False`` and per-layer outputs return :class:`StockCall` (the tower's own forward answers
        them); ``return_dict`` is honoured; every other keyword is accepted and ignored, as the tower's ``**kwargs``
        does (precomputed metadata included: the adapter computes its own).
        """
        try:
            bound = inspect.signature(self._module.forward).bind(*args, **kwargs)
        except TypeError as error:
            raise InputTypeError(
                f"{self.tower_class}.forward(pixel_values, target_sizes, use_vit_merger=True, **kwargs): {error}."
            ) from None
        values = dict(bound.arguments)
        kwargs = values.pop("kwargs", {})
        if values.get("pixel_values") is None or values.get("target_sizes") is None:
            raise InputTypeError(
                f"{self.tower_class}.forward: expected pixel_values and target_sizes, got "
                f"{sorted(k for k, v in values.items() if v is not None)}."
            )
        for name in RECORDING_SWITCHES:
            if kwargs.get(name):
                return StockCall(f"{name} requested")
        if self.merges and not values.get("use_vit_merger", True):
            return StockCall("use_vit_merger=False")
        return_dict = kwargs.get("return_dict")
        return self.inputs(
            values["pixel_values"], values["target_sizes"], return_dict=True if return_dict is None else return_dict
        )

    # -- metadata
    def _positions(self, units: UnitGrid) -> np.ndarray:
        return nearest_positions(units, self.boundaries, self.table_side)

    def _frame_tables(self, units: UnitGrid) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        if not self.merges:
            return {}
        m = units.merge
        rows = units.height * units.width * m * m
        # The merger's windows: the Qwen2.5-VL window layout of the patch grid (merge 1) with 2 x 2 windows.
        patch_grid = np.stack((np.ones_like(rows), units.height * m, units.width * m), axis=1)
        perm, _ = window_layout(unit_grid(patch_grid, 1), WINDOW)
        return {"window_perm": (perm - np.repeat(np.concatenate(([0], np.cumsum(rows)[:-1])), rows), rows)}

    def _assemble(self, frames: list[dict[str, np.ndarray]], cu: np.ndarray) -> dict[str, np.ndarray]:
        if not self.merges:
            return {}
        perm = np.concatenate([f["window_perm"] for f in frames])
        return {"window_index": perm + np.repeat(cu[:-1], np.diff(cu)), "cu_merged": cu // self.merge**2}

    def _extra_buffer_specs(self, budget: int, max_frames: int) -> dict[str, BufferSpec]:
        if not self.merges:
            return {}
        return {
            "window_index": BufferSpec((self._rows(budget),), torch.int64, FillRule.ARANGE),
            "cu_merged": BufferSpec(
                (min(max_frames, budget) + 2,), torch.int32, FillRule.SEQUENCE_BOUNDS, total=budget, chunk=budget
            ),
        }

    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> dict[str, BufferSpec]:
        specs = super().buffer_specs(path, budget, max_items, max_frames)
        specs["position_ids"] = BufferSpec((self._rows(budget),), torch.int64, FillRule.ZERO)
        return specs

    def _replay_extras(self, meta: dict[str, np.ndarray]) -> dict[str, Any]:
        return {"cu_merged": meta.pop("cu_merged")} if self.merges else {}

    def _static_kwargs(self, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, Any]:
        if not self.merges:
            return {}
        return {"window_index": buffers["window_index"], "cu_merged": buffers["cu_merged"], "max_merged": budget}

    def _eager_extras(self, meta: dict[str, np.ndarray]) -> dict[str, Any]:
        if not self.merges:
            return {}
        bounds = meta.pop("cu_merged")
        return {"cu_merged": self._to_device(bounds.astype(np.int32)), "max_merged": int(np.diff(bounds).max())}

    # -- the forward, out of the tower's submodules
    def _run(self, pixels: torch.Tensor, tokens: int, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        tower = self._module
        weight = tower.embeddings.patch_embedding.weight
        with torch.no_grad():
            # Conv2d with stride = kernel on each patch = one matmul of the flattened patch rows.
            x = F.linear(pixels.reshape(pixels.shape[0], -1).to(weight.dtype), weight.reshape(weight.shape[0], -1),
                         tower.embeddings.patch_embedding.bias)
            x = (x + tower.embeddings.position_embedding(kwargs["position_ids"])).unsqueeze(0)
            cu, longest = kwargs["cu_seqlens"], kwargs["max_seqlen"]
            for index, layer in enumerate(tower.encoder.layers):
                x = layer(x, None, cu_seqlens=cu, max_seqlen=longest)
                if self.merges and index == self.insert_layer:
                    x = self._merge_windows(x, kwargs["window_index"])
                    cu, longest = kwargs["cu_merged"], kwargs["max_merged"]
            x = tower.post_layernorm(x)
        return {"last_hidden_state": x[0]}

    def _merge_windows(self, x: torch.Tensor, window_index: torch.Tensor) -> torch.Tensor:
        """``MiniCPMV4_6ViTWindowAttentionMerger.forward`` with its window layout given: ``(1, R, hidden)`` ->
        ``(1, R / 4, hidden)``, one token per 2 x 2 window in window order."""
        merger = self._module.vit_merger
        rows, size = x.shape[1], WINDOW * WINDOW
        windows = torch.arange(0, rows + 1, size, device=x.device, dtype=torch.int32)  # every window has 4 rows
        residual = x[:, window_index, :]
        attended, _ = merger.self_attn(
            hidden_states=merger.layer_norm1(x)[:, window_index, :], cu_seqlens=windows, max_seqlen=size
        )
        patch = (residual + attended).reshape(-1, size, x.shape[-1])
        mixed = merger.linear_2(merger.act(merger.linear_1(merger.pre_norm(patch.flatten(1)))))
        return (mixed + patch.mean(dim=1)).unsqueeze(0)

    def _output(self, last: torch.Tensor | None, cat: dict[str, torch.Tensor]) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        return BaseModelOutputWithPooling(last_hidden_state=last.unsqueeze(0))


def adapter(module: torch.nn.Module, **options: Any) -> MiniCPMVAdapter:
    """The registry factory: ``options`` are :class:`MiniCPMVAdapter`'s keyword arguments."""
    return MiniCPMVAdapter(module, **options)
