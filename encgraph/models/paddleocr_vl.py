"""The PaddleOCR-VL vision tower (``PaddleOCRVisionModel``, config ``PaddleOCRVisionConfig``).

A NaViT SigLIP: patch rows ``(rows, C, P, P)`` (the model adds a leading batch of 1: ``(1, rows, C, P, P)``) with
``grid_thw``, in raster order (no merge inside the tower: the model's projector merges ``2 x 2`` patches after
it), a learned square position table resampled to each image's grid (bilinear; ``align_corners`` is the tower's
own flag: ``True`` in transformers 5.15, ``False`` in 5.25), 2-D rotary positions, full attention per frame and a
final LayerNorm. From transformers 5.15 the tower takes every piece of grid-derived metadata as a keyword argument
(``position_ids``, ``cu_seqlens``, ``max_seqlen``, ``interp_indices``, ``interp_weights``) and then never reads
``grid_thw``: the static forward is the tower's own. encgraph computes the interpolation taps on the host
(:func:`encgraph.models.qwen3_vl.interpolation`, bit for bit as transformers' helper).

Budgets count patch rows (the tower's own output rows: ``last_hidden_state`` ``(rows, hidden)``, ``pooler_output``
``None``, as the tower returns them). The default ladder, 256 to 16,384 rows, spans the pixels of Qwen-VL's (one
224 px image to one 1,792 px one at patch 14).
"""

from __future__ import annotations

from typing import Any

import torch

from encgraph._validate import describe
from encgraph.errors import ConfigError, InputError
from encgraph.models.own_forward import own_forward
from encgraph.models.qwen3_vl import InterpolatedPositions
from encgraph.models.qwen_inputs import QwenVisionInputs
from encgraph.models.qwen_vl import QwenVisionAdapter

__all__ = ["PaddleOCRVLAdapter", "adapter"]


class PaddleOCRVLAdapter(InterpolatedPositions, QwenVisionAdapter):
    """Adapter of a PaddleOCR-VL vision tower; see :class:`~encgraph.models.qwen_vl.QwenVisionAdapter` (options and
    shared buffers; budgets here count patch rows, default 256..16384). The one output, ``last_hidden_state``, is
    always returned.

    Extra buffers: :class:`~encgraph.models.qwen3_vl.InterpolatedPositions`'s.
    """

    family = "PaddleOCR-VL"
    tower_class = "PaddleOCRVisionModel"
    required_attributes = ("vision_model",)
    call_names = ("pixel_values", "grid_thw")
    flat_rows = False
    default_budgets = (256, 16384)  # patch rows

    def _geometry(self, module: torch.nn.Module) -> tuple[int, torch.Tensor]:
        # Merge 1: the tower's rows are its output rows, in raster order (the projector merges after it).
        return 1, module.vision_model.embeddings.patch_embedding.weight

    def _init_family(self, module: torch.nn.Module) -> None:
        embeddings = module.vision_model.embeddings
        mode = getattr(embeddings, "interpolation_mode", "bilinear")
        corners = getattr(embeddings, "interpolation_align_corners", False)
        if mode != "bilinear" or not isinstance(corners, bool):
            raise ConfigError(
                f"module: the {self.family} adapter reproduces bilinear interpolation, the tower uses {mode!r} with "
                f"align_corners={corners!r}."
            )
        # transformers 5.15-5.2x's tower resampled with align_corners=True, 5.25's with False: the tower's own flag.
        self.align_corners = corners
        self.grid_side = int(embeddings.num_grid_per_side)
        self.with_last_hidden_state = True

    def _layout_rewrites(self, module: torch.nn.Module) -> list[Any]:
        # The Conv2d patch embedding reads (rows, C, P, P) already as one matmul's worth of rows: nothing to rewrite.
        return []

    def compile_regions(self) -> list[torch.nn.Module]:
        """The encoder layers: what ``compile="auto"`` compiles (once for all of them and every budget)."""
        return list(self._module.vision_model.encoder.layers)

    @property
    def output_names(self) -> tuple[str, ...]:
        return ("last_hidden_state",)

    # -- inputs: the model's (1, rows, C, P, P)
    def inputs(self, pixel_values: Any, grid_thw: Any, *, return_dict: bool = True) -> QwenVisionInputs:
        """As the base's, also taking the model's leading batch of one (``(1, rows, C, P, P)``), as the tower does."""
        if isinstance(pixel_values, torch.Tensor) and pixel_values.dim() == len(self.row_shape) + 2:
            if pixel_values.shape[0] != 1:
                raise InputError(
                    f"pixel_values: expected (1, rows, {', '.join(map(str, self.row_shape))}) as PaddleOCR-VL's model "
                    f"passes it (one packed batch), got {describe(pixel_values)}."
                )
            pixel_values = pixel_values[0]
        return super().inputs(pixel_values, grid_thw, return_dict=return_dict)

    # -- forwards and results
    def _run(self, pixels: torch.Tensor, tokens: int, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            out = own_forward(self._module)(pixels.unsqueeze(0), grid_thw=None, return_dict=True, **kwargs)
        return {"last_hidden_state": out.last_hidden_state.reshape(tokens, -1)}

    def _output(self, last: torch.Tensor | None, cat: dict[str, torch.Tensor]) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        return BaseModelOutputWithPooling(last_hidden_state=last, pooler_output=None)


def adapter(module: torch.nn.Module, **options: Any) -> PaddleOCRVLAdapter:
    """The registry factory: ``options`` are :class:`PaddleOCRVLAdapter`'s keyword arguments."""
    return PaddleOCRVLAdapter(module, **options)
