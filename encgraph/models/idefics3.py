"""The Idefics3 / SmolVLM vision tower (``Idefics3VisionTransformer`` / ``SmolVLMVisionTransformer``, configs
``Idefics3VisionConfig`` / ``SmolVLMVisionConfig``; ``model.model.vision_model``): one tower, two registrations.

The tower takes zero-padded images (tiles) ``(B, C, H, W)`` and a ``patch_attention_mask`` ``(B, H/P, W/P)``, embeds
every patch (a ``P``-stride convolution plus a learned table at bucketised fractional positions), runs SigLIP
encoder layers under a key-padding mask and a final LayerNorm, and returns ``last_hidden_state`` ``(B, H/P * W/P,
hidden)``, padded patches included (its models' connectors read every row). The models hand it their real images
(and SmolVLM its video frames, as images), all-zero padding images dropped.

encgraph takes the same call and reads the mask on the host (:mod:`encgraph.models.idefics3_layout`): one item per
image of its real patches (a top-left rectangle of ``h x w``, as the processors make it), gathered on the device into
patch rows ``(rows, C, P, P)`` (one gather, its index built on the host), then the Qwen-VL pattern
(:class:`~encgraph.models.qwen_vl.QwenVisionAdapter`, merge 1): position ids and ``cu_seqlens`` computed on the host,
packed varlen attention per image in place of the tower's mask. The tower's attention takes no packed metadata, so
while the adapter's forwards run each layer's ``self_attn`` has an instance forward that attends per ``cu_seqlens``
(the layers themselves run as they are, and are what ``compile="auto"`` compiles).

The padded patches: the tower's mask hides them as keys but not as queries, so each still attends to its image's
real patches; all of an image's are the same zero patch at position 0, so they leave every layer as one row. The
static forward carries one such query row per ``cu_seqlens`` slot after the packed rows, through every layer
(:func:`~encgraph.models.idefics3_layout.pad_query_attention`), and ``output_for_call`` writes each image's row at
its padded patches: the output is the tower's, padded rows included, for SDPA and eager attention (the tower's
default). Under a flash attention implementation the tower zeroes the padded queries' attention instead: a call
with padded patches then goes to the tower's own forward, as do masks that are not a top-left rectangle and masked
patches with non-zero pixels (each counted with its reason).

Budgets count patch rows (the tower's output rows); the default ladder, 256 to 16,384, holds one 729-row
SmolVLM tile (384 px, patch 14) up to sixteen per batch, with the runner's default of 16 items. Hidden states are
captured as :mod:`encgraph.models.hidden_choice` says (their last entry is the last layer's output, before the final
norm: not ``last_hidden_state``). ``output_attentions`` is answered by the tower's own forward.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs
import numpy as np
import torch

from encgraph._validate import check_padded_images, describe
from encgraph.capture.protocol import BufferSpec, FillRule, StockCall
from encgraph.capture.upload import to_device
from encgraph.errors import InputError, InputTypeError
from encgraph.models import call_args
from encgraph.models.attention import packed_attention
from encgraph.models.hidden_choice import (
    HIDDEN,
    HiddenStatesChoice,
)
from encgraph.models.idefics3_layout import (
    MaskedPixels,
    NotRectangular,
    bucket_positions,
    casts_fractions,
    needs_mask,
    pad_query_attention,
    padded_layout,
    read_mask,
    slot_mask,
    slot_rows,
    tower_boundaries,
)
from encgraph.models.layout import LayoutPatch, engaged, restore_all
from encgraph.models.qwen_grid import UnitGrid, unit_grid
from encgraph.models.qwen_inputs import QwenVisionInputs
from encgraph.models.qwen_vl import QwenVisionAdapter

__all__ = ["Idefics3Adapter", "Idefics3Inputs", "adapter"]

_PARAMETERS = ("pixel_values", "patch_attention_mask")
PADDING = "padding."
"""Prefix of the outputs that hold, per packed row, its image's padding row (read at each image's first row)."""


@attrs.frozen(eq=False)
class Idefics3Inputs(QwenVisionInputs):
    """:class:`~encgraph.models.qwen_inputs.QwenVisionInputs` of real patch rows ``(rows, C, P, P)`` and grid
    ``(n, 3)`` (``(1, h, w)`` real patches per image), plus the call's padded patch grid ``padded`` ``(H/P, W/P)``
    and the ``hidden_states`` layout it asked for (``None``: none)."""

    padded: tuple[int, int] = (0, 0)
    hidden_layout: tuple[int | None, ...] | None = None


class Idefics3Adapter(HiddenStatesChoice, QwenVisionAdapter):
    """Adapter of an Idefics3 or SmolVLM vision tower; see :class:`~encgraph.models.qwen_vl.QwenVisionAdapter`
    (options and buffers; budgets here count patch rows, default 256..16384, one frame per item).

    Extra option ``hidden_states``: which entries of the tower's ``hidden_states`` to capture (``None``: learned
    from the calls, ``"all"``, or indices). ``position_ids`` is ``(R,)`` int64 (the table's index, ZERO).
    """

    family = "Idefics3"
    tower_class = "Idefics3VisionTransformer"
    required_attributes = ("embeddings", "encoder", "post_layernorm")
    call_names = _PARAMETERS
    flat_rows = False
    default_budgets = (256, 16384)  # patch rows

    def __init__(self, module: torch.nn.Module, *, max_frames_per_item: int = 1,
                 hidden_states: str | Iterable[int] | None = None, **options: Any) -> None:
        self._hidden_option = hidden_states  # read by _init_family, before the tower is changed
        super().__init__(module, max_frames_per_item=max_frames_per_item, **options)
        # Last, as the base's rewrites: packed attention in every layer, engaged only inside the adapter's forwards.
        self._attention = [_packed_attention(layer.self_attn) for layer in module.encoder.layers]

    def _geometry(self, module: torch.nn.Module) -> tuple[int, torch.Tensor]:
        # Merge 1: the tower's rows are its output rows, raster order per image (the connector shuffles after it).
        return 1, module.embeddings.patch_embedding.weight

    def _init_family(self, module: torch.nn.Module) -> None:
        self.family = type(module).__name__.replace("VisionTransformer", "")
        self.tower_class = type(module).__name__
        self.with_last_hidden_state = True
        self.patch = int(self.patch_shape[-1])
        self.num_layers = len(module.encoder.layers)
        self._init_hidden(self._hidden_option)
        embeddings = module.embeddings
        self.side = int(embeddings.num_patches_per_side)
        self.boundaries = tower_boundaries(self.side, self._device)
        self.cast = self._dtype if casts_fractions(embeddings) else None
        returns = str(inspect.unwrap(type(module).forward).__annotations__.get("return", ""))
        name = "BaseModelOutputWithPooling" if "BaseModelOutputWithPooling" in returns else "BaseModelOutput"
        self.output_class = getattr(importlib.import_module("transformers.modeling_outputs"), name)

    def _layout_rewrites(self, module: torch.nn.Module) -> list[Any]:
        # The Conv2d patch embedding reads (rows, C, P, P) already as one matmul's worth of rows: nothing to rewrite.
        return []

    @contextlib.contextmanager
    def _engaged(self) -> Iterator[None]:
        with super()._engaged(), engaged(self._attention):
            yield

    def compile_regions(self) -> list[torch.nn.Module]:
        """The encoder layers: what ``compile="auto"`` compiles (once for all of them and every budget)."""
        return list(self._module.encoder.layers)

    @property
    def output_names(self) -> tuple[str, ...]:
        names = ("last_hidden_state",) + self._hidden_names()
        return names + tuple(PADDING + n for n in names)

    # -- inputs: the model's padded images and patch mask
    def inputs(self, pixel_values: Any, patch_attention_mask: Any = None, *, return_dict: bool = True,
               hidden_layout: tuple[int | None, ...] | None = None) -> Idefics3Inputs:
        """Validate the tower's own arguments (``pixel_values (B, C, H, W)``, zero-padded images, and
        ``patch_attention_mask (B, H/P, W/P)``, on the pixels' device or the host, read on the host; ``None``: every
        patch real) into patch rows.
        Raises :class:`~encgraph.models.idefics3_layout.NotRectangular` or ``MaskedPixels`` for what only the
        tower's own forward answers."""
        p = self.patch
        pv = check_padded_images(pixel_values, channels=self.patch_shape[0], device=self._device, min_side=p)
        n, _, height, width = pv.shape
        padded = (height // p, width // p)
        mask = patch_attention_mask
        if mask is not None and (not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (n, *padded)
                                 or mask.is_floating_point() or mask.device.type not in ("cpu", pv.device.type)):
            raise InputError(
                f"patch_attention_mask: expected a bool tensor ({n}, {padded[0]}, {padded[1]}) on {pv.device} or the "
                f"host (one row per image, (H/{p}, W/{p}) patches), got {describe(mask)}."
            )
        if not isinstance(return_dict, bool):
            raise InputTypeError(f"return_dict: expected True or False, got {describe(return_dict)}.")
        grid, _ = read_mask(pv, mask, p)
        return Idefics3Inputs(self._patch_rows(pv, grid, padded), grid, return_dict, padded, hidden_layout)

    def _patch_rows(self, pv: torch.Tensor, grid: np.ndarray, padded: tuple[int, int]) -> torch.Tensor:
        """Every image's real patches ``(rows, C, P, P)``, images in order, raster order in each (the tower's)."""
        p, (rows, cols) = self.patch, padded
        tiles = pv[:, :, : rows * p, : cols * p].unflatten(3, (cols, p)).unflatten(2, (rows, p))
        tiles = tiles.permute(0, 2, 4, 1, 3, 5)  # (images, rows, cols, C, P, P): a view
        if (grid[:, 1] == rows).all() and (grid[:, 2] == cols).all():
            return tiles.reshape(-1, *tiles.shape[3:])
        units = unit_grid(grid, 1)
        index = torch.from_numpy(np.stack((units.frame, units.y, units.x)))
        index = to_device(index, pv.device)
        return tiles[index[0], index[1], index[2]]

    def inputs_from_call(self, *args: Any, **kwargs: Any) -> Idefics3Inputs | StockCall:
        """The tower's ``forward(pixel_values, patch_attention_mask=None, **kwargs)`` arguments as inputs.

        ``return_dict`` and ``output_hidden_states`` (default: the config's) are honoured, hidden states from the
        captured ones (learned before the first capture); ``output_attentions``, hidden states not captured, a mask
        that is not a top-left rectangle, masked patches with non-zero pixels, and padded patches under a flash
        attention implementation get a :class:`StockCall` (the tower's own forward answers). Other keywords are
        ignored, as the tower's ``**kwargs`` swallows them."""
        values = call_args.bind(f"{self.tower_class}.forward", _PARAMETERS, args, kwargs)
        config = self._module.config
        if call_args.switch(config, kwargs, "output_attentions"):
            return StockCall("output_attentions requested")
        layout = self._hidden_for_layout(call_args.switch(config, kwargs, "output_hidden_states"))
        if isinstance(layout, StockCall):
            return layout
        try:
            inputs = self.inputs(values.get("pixel_values"), values.get("patch_attention_mask"),
                                 return_dict=bool(call_args.return_dict(config, kwargs)), hidden_layout=layout)
        except NotRectangular:
            return StockCall("patch_attention_mask not a top-left rectangle")
        except MaskedPixels:
            return StockCall("masked patches with non-zero pixels")
        padded = bool((inputs.grid[:, 1] * inputs.grid[:, 2] < inputs.padded[0] * inputs.padded[1]).any())
        if padded and "flash" in str(getattr(config, "_attn_implementation", "")):
            return StockCall("padded patches under flash attention")  # the tower zeroes their attention
        return inputs

    # -- metadata, buffers and forwards
    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> dict[str, BufferSpec]:
        self.frozen = True  # the runner allocates (then captures) with the outputs as they are now: stop learning
        specs = super().buffer_specs(path, budget, max_items, max_frames)
        specs["position_ids"] = BufferSpec((self._rows(budget),), torch.int64, FillRule.ZERO)
        return specs

    def _positions(self, units: UnitGrid) -> np.ndarray:
        frame = units.frame
        return bucket_positions(units.height[frame], units.width[frame], units.y, units.x, self.side,
                                self.boundaries, self.cast)

    def _run(self, pixels: torch.Tensor, tokens: int, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The tower's computation over ``tokens`` packed rows and one padding query per ``cu_seqlens`` slot."""
        tower = self._module
        embeddings = tower.embeddings
        cu = kwargs["cu_seqlens"]
        keep = set(self.held_hidden)
        with torch.no_grad():
            conv, table = embeddings.patch_embedding, embeddings.position_embedding
            x = conv(pixels.to(conv.weight.dtype)).flatten(1) + table(kwargs["position_ids"])
            # The padded patches' input: a zero patch (the conv's bias) at position 0.
            pad = table.weight[0] if conv.bias is None else conv.bias + table.weight[0]
            slots = cu.shape[0] - 1
            x = torch.cat([x, pad.to(x.dtype).expand(slots, -1)]).unsqueeze(0)
            # The masked SDPA's (slots, rows) mask only where it runs (not on CUDA's varlen path, inside the graphs).
            mask, seg = slot_mask(cu, tokens) if needs_mask(x) else (None, slot_rows(cu, tokens))
            packed = {"cu_seqlens": cu, "max_seqlen": kwargs["max_seqlen"], "slot_mask": mask}
            seg = seg + tokens  # each row's padding query (its slot's), after the rows
            named = {f"{HIDDEN}0": x[0]} if 0 in keep else {}
            for i, layer in enumerate(tower.encoder.layers, start=1):
                x = layer(x, None, **packed)
                if i in keep:
                    named[f"{HIDDEN}{i}"] = x[0]
            named["last_hidden_state"] = tower.post_layernorm(x)[0]
        return {k: v for name, rows in named.items() for k, v in ((name, rows[:tokens]), (PADDING + name, rows[seg]))}

    # -- results
    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One item's outputs: ``{"last_hidden_state": (rows, hidden), "padding.last_hidden_state": (rows,
        hidden) (its padding row, repeated), "hidden_states.<i>": ..., ...}``."""
        return dict(parts["default"])

    def output_for_call(self, results: list[dict[str, torch.Tensor]], inputs: QwenVisionInputs) -> Any:
        """The tower's own output type: ``last_hidden_state`` ``(B, H/P * W/P, hidden)`` (each image's real patches
        in its top-left rectangle, its padding row at the others), ``hidden_states`` as asked, or its
        ``to_tuple()`` for ``return_dict=False``."""
        rows, cols = getattr(inputs, "padded", (0, 0))
        grid = inputs.grid
        full = bool((grid[:, 1] == rows).all() and (grid[:, 2] == cols).all())
        index = None
        if not full:
            index = to_device(torch.from_numpy(padded_layout(grid, rows, cols)), results[0]["last_hidden_state"].device)
        cat = {}
        for name in ("last_hidden_state",) + self._hidden_names():
            real = torch.cat([r[name] for r in results])
            if index is not None:
                real = torch.cat([real, torch.stack([r[PADDING + name][0] for r in results])])[index]
            cat[name] = real.reshape(grid.shape[0], rows * cols, -1) if rows else real.unsqueeze(0)
        hidden = self._hidden_tuple(cat, getattr(inputs, "hidden_layout", None))
        out = self.output_class(last_hidden_state=cat["last_hidden_state"], hidden_states=hidden)
        return out if inputs.return_dict else out.to_tuple()

    def unwrap(self) -> torch.nn.Module:
        """Restore the layers' attention (and what the base changed), and return the tower."""
        restore_all(self._attention)
        return super().unwrap()


def _packed_attention(attention: torch.nn.Module) -> LayoutPatch:
    """An instance forward for one layer's ``self_attn``: packed varlen attention of the real rows per
    ``cu_seqlens``, and each slot's padding query attending to its sequence (the trailing ``slots`` rows)."""

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                cu_seqlens: torch.Tensor, max_seqlen: int, slot_mask: torch.Tensor | None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
        x = hidden_states[0]
        total, rows = x.shape[0], x.shape[0] - (cu_seqlens.shape[0] - 1)  # one padding query per slot, at the end
        shape = (total, -1, attention.head_dim)
        q, k, v = (proj(x).view(shape) for proj in (attention.q_proj, attention.k_proj, attention.v_proj))
        real = packed_attention(q[:rows], k[:rows], v[:rows], cu_seqlens, max_seqlen, scale=attention.scale)
        pad = pad_query_attention(q[rows:], k[:rows], v[:rows], slot_mask, attention.scale, cu_seqlens, max_seqlen)
        return attention.out_proj(torch.cat([real, pad]).reshape(1, total, -1)), None

    return LayoutPatch(attention, "packed varlen attention per cu_seqlens", forward)


def adapter(module: torch.nn.Module, **options: Any) -> Idefics3Adapter:
    """The registry factory: ``options`` are :class:`Idefics3Adapter`'s keyword arguments."""
    return Idefics3Adapter(module, **options)
