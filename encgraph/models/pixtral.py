"""The Pixtral vision tower (``PixtralVisionModel``, config ``PixtralVisionConfig``): Mistral 3's
(``model.model.vision_tower``) and Pixtral-12B's in LLaVA.

The tower takes zero-padded images ``(B, C, maxH, maxW)`` with ``image_sizes`` (pixels, per image), crops each
image's patch embeddings to its size, packs every image's patches into one sequence (raster order, images in
order), applies ``ln_pre``, 2-D rotary positions per image and a block-diagonal mask (one block per image), and
returns ``last_hidden_state`` ``(1, patches, hidden)`` and, where asked, ``hidden_states`` (the first layer's input,
then each layer's output; the last is ``last_hidden_state`` itself: no final norm).

encgraph takes the same call, cuts the images into patch rows ``(rows, C, P, P)`` (one gather on the device, its
index built on the host), and runs the Qwen-VL pattern (:class:`~encgraph.models.qwen_vl.QwenVisionAdapter`,
merge 1): one item per image of ``h*w`` rows, position ids and ``cu_seqlens`` computed on the host, packed varlen
attention per image. The tower's forward computes positions with per-image Python loops and takes no precomputed
metadata, so the static forward is the tower's own modules in its order (``patch_conv``, ``ln_pre``, the rotary
embedding, the layers). Rotary ids: ``(row, col)`` pairs for the axial rotary of transformers 5.25; ``row *
max_side + col`` into the frequency table of 5.15 (sides at most ``image_size / patch_size``).

Budgets count patch rows; the default ladder is 256 to 16,384 (four 1024 px Pixtral-12B images at patch 16).
Hidden states are captured as :mod:`encgraph.models.hidden_choice` says (learned from the calls before the first
capture unless ``hidden_states`` is given); Mistral 3 on transformers 5.25 asks for the last one only, which is
``last_hidden_state``. ``output_attentions`` is answered by the tower's own forward.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from encgraph._validate import check_int, check_padded_images, describe
from encgraph.capture.protocol import BufferSpec, FillRule, StockCall
from encgraph.capture.upload import to_device
from encgraph.errors import InputError, InputTypeError
from encgraph.models import call_args
from encgraph.models.hidden_choice import (
    HIDDEN,
    HiddenStatesChoice,
)
from encgraph.models.qwen_grid import UnitGrid, rotary_positions, unit_grid
from encgraph.models.qwen_inputs import QwenVisionInputs
from encgraph.models.qwen_vl import QwenVisionAdapter

__all__ = ["PixtralAdapter", "PixtralInputs", "adapter"]

_PARAMETERS = ("pixel_values", "image_sizes")


@attrs.frozen(eq=False)
class PixtralInputs(QwenVisionInputs):
    """:class:`~encgraph.models.qwen_inputs.QwenVisionInputs` of patch rows ``(rows, C, P, P)`` and grid ``(n, 3)``
    (``t = 1``), plus the ``hidden_states`` layout the call asked for (``None``: none)."""

    hidden_layout: tuple[int | None, ...] | None = None


class PixtralAdapter(HiddenStatesChoice, QwenVisionAdapter):
    """Adapter of a Pixtral vision tower; see :class:`~encgraph.models.qwen_vl.QwenVisionAdapter` (options and
    buffers; budgets here count patch rows, default 256..16384).

    Extra option ``hidden_states``: which entries of the tower's ``hidden_states`` to capture (``None``: learned
    from the calls, ``"all"``, or indices); see :class:`~encgraph.models.fixed.FixedResolutionAdapter`.
    """

    family = "Pixtral"
    tower_class = "PixtralVisionModel"
    required_attributes = ("patch_conv", "ln_pre", "transformer", "patch_positional_embedding")
    call_names = _PARAMETERS
    flat_rows = False
    tied_last = True
    default_budgets = (256, 16384)  # patch rows

    def __init__(self, module: torch.nn.Module, *, hidden_states: str | Iterable[int] | None = None,
                 **options: Any) -> None:
        self._hidden_option = hidden_states  # read by _init_family, before the tower is changed
        super().__init__(module, **options)

    def _geometry(self, module: torch.nn.Module) -> tuple[int, torch.Tensor]:
        # Merge 1: the tower's rows are its output rows, in raster order per image (Mistral 3 merges after it).
        return 1, module.patch_conv.weight

    def _init_family(self, module: torch.nn.Module) -> None:
        self.with_last_hidden_state = True
        self.patch = int(self.patch_shape[-1])
        self.num_layers = len(module.transformer.layers)
        self._init_hidden(self._hidden_option)
        # transformers 5.15's rotary is a table of (image_size / patch)^2 positions indexed by row * side + col;
        # 5.25's axial rotary takes (row, col) pairs.
        table = module.patch_positional_embedding.inv_freq
        self.max_side = int(module.config.image_size) // self.patch if table.dim() == 2 else None
        tower_module = importlib.import_module(type(module).__module__)
        self.output_class = getattr(tower_module, "BaseModelOutputWithPooling", None) or tower_module.BaseModelOutput

    def _layout_rewrites(self, module: torch.nn.Module) -> list[Any]:
        # The Conv2d patch embedding reads (rows, C, P, P) already as one matmul's worth of rows: nothing to rewrite.
        return []

    def compile_regions(self) -> list[torch.nn.Module]:
        """The transformer layers: what ``compile="auto"`` compiles (once for all of them and every budget)."""
        return list(self._module.transformer.layers)

    @property
    def output_names(self) -> tuple[str, ...]:
        return ("last_hidden_state",) + self._hidden_names()

    # -- inputs: the model's padded images and image_sizes
    def inputs(self, pixel_values: Any, image_sizes: Any = None, *, return_dict: bool = True,
               hidden_layout: tuple[int | None, ...] | None = None) -> PixtralInputs:
        """Validate the tower's own arguments (``pixel_values (B, C, H, W)``, zero-padded images, and
        ``image_sizes (B, 2)`` in pixels, read on the host; ``None``: every image is ``H x W``) into patch rows."""
        pv = check_padded_images(pixel_values, channels=self.patch_shape[0], device=self._device)
        n, _, height, width = pv.shape
        sizes = np.tile([height, width], (n, 1)) if image_sizes is None else _sizes(image_sizes, n)
        if not isinstance(return_dict, bool):
            raise InputTypeError(f"return_dict: expected True or False, got {describe(return_dict)}.")
        grid = np.concatenate((np.ones((n, 1), np.int64), sizes // self.patch), axis=1)
        bad = np.nonzero((grid[:, 1:].min(1) < 1) | (sizes[:, 0] > height) | (sizes[:, 1] > width))[0]
        if bad.size:
            i = int(bad[0])
            raise InputError(
                f"image_sizes: image {i} is {sizes[i, 0]}x{sizes[i, 1]} px; each image must hold at least one "
                f"{self.patch} px patch a side and fit pixel_values' {height}x{width} (its patches are cropped "
                "from them)."
            )
        if self.max_side is not None and grid[:, 1:].max() > self.max_side:
            raise InputError(
                f"image_sizes: the tower's rotary table holds {self.max_side} x {self.max_side} patches (its config's "
                f"image_size), got an image of {grid[:, 1:].max()} patches a side; resize it as the processor does."
            )
        return PixtralInputs(self._patch_rows(pv, grid), grid, return_dict, hidden_layout)

    def _patch_rows(self, pv: torch.Tensor, grid: np.ndarray) -> torch.Tensor:
        """Every image's patches ``(rows, C, P, P)``, images in order, raster order in each (the tower's order)."""
        p = self.patch
        rows, cols = pv.shape[2] // p, pv.shape[3] // p
        tiles = pv[:, :, : rows * p, : cols * p].unflatten(3, (cols, p)).unflatten(2, (rows, p))
        tiles = tiles.permute(0, 2, 4, 1, 3, 5)  # (images, rows, cols, C, P, P): a view
        if (grid[:, 1] == rows).all() and (grid[:, 2] == cols).all():
            return tiles.reshape(-1, *tiles.shape[3:])
        units = unit_grid(grid, 1)
        index = torch.from_numpy(np.stack((units.frame, units.y, units.x)))
        index = to_device(index, pv.device)
        return tiles[index[0], index[1], index[2]]

    def sample_inputs(self, path: str, tokens: int) -> QwenVisionInputs:
        """As the base's (one image of about ``tokens`` rows), but in images of at most the rotary table's side
        where the tower has one (transformers 5.15)."""
        side = self.max_side
        if side is None:
            return super().sample_inputs(path, tokens)
        full, rest = divmod(check_int("tokens", tokens, minimum=1), side * side)
        shapes = [(side, side)] * full
        if rest:
            a = math.isqrt(rest)
            shapes.append((a, min(rest // a, side)))
        grid = np.array([(1, h, w) for h, w in shapes], dtype=np.int64)
        pixels = torch.randn(int(grid.prod(1).sum()), *self.row_shape, device=self._device).to(self._dtype)
        return QwenVisionInputs(pixels, grid)

    def inputs_from_call(self, *args: Any, **kwargs: Any) -> PixtralInputs | StockCall:
        """The tower's ``forward(pixel_values, image_sizes=None, **kwargs)`` arguments as inputs.

        ``return_dict`` and ``output_hidden_states`` (default: the config's) are honoured, the hidden states from
        the captured ones (learned before the first capture); a call asking for hidden states not captured, or for
        ``output_attentions``, gets a :class:`StockCall` (the tower's own forward answers it). Other keywords are
        ignored, as the tower's ``**kwargs`` swallows them."""
        values = call_args.bind(f"{self.tower_class}.forward", _PARAMETERS, args, kwargs)
        config = self._module.config
        if call_args.switch(config, kwargs, "output_attentions"):
            return StockCall("output_attentions requested")
        layout = self._hidden_for_layout(call_args.switch(config, kwargs, "output_hidden_states"))
        if isinstance(layout, StockCall):
            return layout
        return self.inputs(values.get("pixel_values"), values.get("image_sizes"),
                           return_dict=bool(call_args.return_dict(config, kwargs)), hidden_layout=layout)

    # -- buffers and forwards
    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> dict[str, BufferSpec]:
        self.frozen = True  # the runner allocates (then captures) with the outputs as they are now: stop learning
        specs = super().buffer_specs(path, budget, max_items, max_frames)
        if self.max_side is not None:
            specs["position_ids"] = BufferSpec((self._rows(budget),), torch.int64, FillRule.ZERO)
        return specs

    def _positions(self, units: UnitGrid) -> np.ndarray:
        positions = rotary_positions(units)  # (row, col), raster order: the tower's meshgrid
        return positions if self.max_side is None else positions[:, 0] * self.max_side + positions[:, 1]

    def _run(self, pixels: torch.Tensor, tokens: int, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        tower = self._module
        cu, longest = kwargs["cu_seqlens"], kwargs["max_seqlen"]
        packed = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
        keep = set(self.held_hidden)
        with torch.no_grad():
            weight = tower.patch_conv.weight
            x = tower.ln_pre(tower.patch_conv(pixels.to(weight.dtype)).reshape(1, tokens, -1))
            rotary = tower.patch_positional_embedding(x, kwargs["position_ids"])
            named = {f"{HIDDEN}0": x[0]} if 0 in keep else {}
            for i, layer in enumerate(tower.transformer.layers, start=1):
                x = layer(x, None, position_embeddings=rotary, **packed)
                if i in keep:
                    named[f"{HIDDEN}{i}"] = x[0]
        named["last_hidden_state"] = x[0]
        return named

    # -- results
    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One item's outputs: ``{"last_hidden_state": (rows, hidden), "hidden_states.<i>": ...}``."""
        return dict(parts["default"])

    def output_for_call(self, results: list[dict[str, torch.Tensor]], inputs: QwenVisionInputs) -> Any:
        """The tower's own output type (``last_hidden_state (1, rows, hidden)``, ``hidden_states`` as asked), or
        its ``to_tuple()`` for ``return_dict=False``."""
        cat = {name: torch.cat([r[name] for r in results]).unsqueeze(0) for name in self.output_names}
        hidden = self._hidden_tuple(cat, getattr(inputs, "hidden_layout", None))
        out = self.output_class(last_hidden_state=cat["last_hidden_state"], hidden_states=hidden)
        return out if inputs.return_dict else out.to_tuple()


def _sizes(image_sizes: Any, n: int) -> np.ndarray:
    """``image_sizes`` as an ``(n, 2)`` int64 host array (a device tensor is copied once, as the tower reads it)."""
    if isinstance(image_sizes, torch.Tensor):
        value = image_sizes.detach().cpu().numpy() if not image_sizes.is_floating_point() else None
    elif isinstance(image_sizes, Sequence):
        try:
            value = np.asarray(image_sizes)
        except ValueError:
            value = None
    else:
        value = None
    if value is None or value.dtype.kind not in "iu" or value.shape != (n, 2):
        raise InputError(
            f"image_sizes: expected ({n}, 2) integer (height, width) pixels, one row per image of pixel_values, got "
            f"{describe(image_sizes)}."
        )
    return value.astype(np.int64)


def adapter(module: torch.nn.Module, **options: Any) -> PixtralAdapter:
    """The registry factory: ``options`` are :class:`PixtralAdapter`'s keyword arguments."""
    return PixtralAdapter(module, **options)
