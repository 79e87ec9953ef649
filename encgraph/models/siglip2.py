"""The SigLIP2 NaFlex vision tower (``Siglip2VisionModel``, config ``Siglip2VisionConfig``): SigLIP2's own
(``model.vision_model``) and LFM2-VL's (``model.model.vision_tower``).

The tower takes ``pixel_values`` ``(B, L, C*P*P)`` (each image's ``h*w`` patch rows in raster order, then zero
padding rows up to the processor's ``max_num_patches`` ``L``), ``pixel_attention_mask`` ``(B, L)`` (1 on an image's
first ``h*w`` rows) and ``spatial_shapes`` ``(B, 2)`` (``h, w`` in patches). It embeds the rows with a linear patch
embedding, adds its learned ``G x G`` position table resized to each image's ``h x w`` (bilinear, antialiased:
``F.interpolate(..., antialias=True)`` in transformers 5.15, the same weights written out as a matmul in 5.25),
runs its layers under a padding mask, a final LayerNorm, and (``vision_use_head``: SigLIP2's, not LFM2-VL's) a
multi-head attention pooling head whose probe attends over each image's valid rows. It returns
``last_hidden_state`` ``(B, L, hidden)`` and ``pooler_output`` ``(B, hidden)`` (``None`` without the head).

encgraph takes the same call and runs the Qwen-VL pattern (:class:`~encgraph.models.qwen_vl.QwenVisionAdapter`,
merge 1): one item per image of its ``h*w`` real rows (gathered on the device, the index built on the host; the
padding rows are dropped), packed varlen attention per image (``cu_seqlens``) in place of the mask. The position
embedding of a row is ``(a_h outer a_w) @ table``: the per-axis antialias weights ``a_h``, ``a_w`` (``G`` each) come
from the host (:func:`axis_weights`, the float32 operations of transformers 5.25's helper, cached per axis
length), and the graph only forms their outer product and multiplies, as 5.25 does. The head runs over the packed
rows: one query, the probe, against every row, softmax per image (bounded by ``cu_seqlens`` in the graph).

Outputs (:meth:`Siglip2Adapter.output_for_call`) are the tower's type and shapes: each image's rows go back to
its first ``h*w`` rows of ``(B, L, hidden)``. **The padding rows of ``last_hidden_state`` are zero.** The tower's
own padding rows are what its attention makes of them (with SDPA or eager attention each is a query that attends
to its image's valid rows; with Flash attention its attention output is zero), not data: LFM2-VL drops them and
the head masks them. Against the tower, the valid rows and ``pooler_output`` are equal to float rounding
(transformers 5.25: the position matmul over packed rows in place of the padded batch); transformers 5.15 resamples
with ``F.interpolate`` (on a GPU in the table's dtype), whose sums the weights reproduce to float rounding.

Budgets count patch rows; the default ladder is 256 to 8192 (SigLIP2's processor's 256 patches an image to eight
LFM2-VL tiles of 1024). ``output_hidden_states`` and ``output_attentions`` are the tower's own calls, counted; so
is a call whose mask is not each image's first ``h*w`` rows, or has none.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from encgraph._validate import check_int, check_pixels, describe
from encgraph.capture.upload import to_device
from encgraph.errors import InputError, InputTypeError
from encgraph.models import call_args
from encgraph.models.attention import hf_attention_forward
from encgraph.models.layout import LayoutPatch, engaged, restore_all
from encgraph.models.protocol import BufferSpec, FillRule, StockCall
from encgraph.models.qwen_grid import UnitGrid
from encgraph.models.qwen_inputs import QwenVisionInputs
from encgraph.models.qwen_vl import QwenVisionAdapter

__all__ = ["Siglip2Adapter", "Siglip2Inputs", "UnusualMask", "adapter", "axis_weights", "position_weights"]

_PARAMETERS = ("pixel_values", "pixel_attention_mask", "spatial_shapes")
POSITION = ("pos_h", "pos_w")
"""Per patch row, its row's and its column's weights over the table's ``G`` rows and columns."""


@functools.lru_cache(maxsize=256)
def axis_weights(grid: int, length: int) -> np.ndarray:
    """``(length, grid)`` float32: the weights of ``F.interpolate(mode="bilinear", align_corners=False,
    antialias=True)`` resizing an axis of ``grid`` samples to ``length``, in the float32 torch operations of
    transformers 5.25's ``Siglip2VisionEmbeddings.resize_positional_embeddings`` (on the CPU), so that they equal
    its weights bit for bit there. Downsampling widens the triangle (support ``grid / length``), so a weight row
    has up to ``grid`` taps, not 2."""
    check_int("grid", grid, minimum=1)
    check_int("length", length, minimum=1)
    size = torch.tensor([float(length)], dtype=torch.float32)
    scale = grid / size
    support = scale.clamp(min=1)
    center = (torch.arange(length, dtype=torch.float32) + 0.5) * scale - 0.5
    source = torch.arange(grid, dtype=torch.float32)
    weights = (1 - (source - center[:, None]).abs_().div_(support)).clamp_(min=0)
    weights = weights / weights.sum(-1, keepdim=True)
    out = weights.numpy()
    out.setflags(write=False)
    return out


def position_weights(grid: int, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per patch row of an ``height x width`` image (raster order), its row's and its column's axis weights:
    ``(h*w, grid)`` float32 each; the row's position embedding is ``outer(pos_h, pos_w).flatten() @ table``."""
    rows, cols = axis_weights(grid, height), axis_weights(grid, width)
    return np.repeat(rows, width, axis=0), np.tile(cols, (height, 1))


class UnusualMask(InputError):
    """A ``pixel_attention_mask`` that is not each image's first ``h*w`` rows (the processor's): the tower masks
    other rows than the graphs would drop; ``graphed(tower)`` leaves such a call to the tower."""


@attrs.frozen(eq=False)
class Siglip2Inputs(QwenVisionInputs):
    """:class:`~encgraph.models.qwen_inputs.QwenVisionInputs` of the images' real rows ``(rows, C*P*P)`` and grid
    ``(n, 3)`` (``t = 1``), plus the call's padded length ``L`` (``max_patches``; ``None``: the rows' own)."""

    max_patches: int | None = None


class Siglip2Adapter(QwenVisionAdapter):
    """Adapter of a SigLIP2 NaFlex vision tower; see :class:`~encgraph.models.qwen_vl.QwenVisionAdapter` (options
    and shared buffers; budgets here count patch rows, default 256..8192).

    Buffers per budget ``R`` (no ``position_ids``: no rotary): ``pixels`` ``(R, C*P*P)``, ``cu_seqlens``, and
    ``pos_h`` / ``pos_w`` ``(R, G)`` float32 (ZERO: padding rows get a zero position embedding)."""

    family = "SigLIP2 NaFlex"
    tower_class = "Siglip2VisionModel"
    required_attributes = ("embeddings", "encoder", "post_layernorm")
    call_names = ("pixel_values", "spatial_shapes")
    flat_rows = True
    default_budgets = (256, 8192)  # patch rows

    def __init__(self, module: torch.nn.Module, **options: Any) -> None:
        super().__init__(module, **options)
        # The tower's attention drops its keyword arguments before the attention function: while the adapter's
        # forwards run, each layer's attention passes them on (cu_seqlens), its class untouched.
        self._packed = [LayoutPatch(layer.self_attn, "attention keywords passed on", _attention_forward(layer.self_attn))
                        for layer in module.encoder.layers]

    @contextlib.contextmanager
    def _engaged(self) -> Iterator[None]:
        with super()._engaged(), engaged(self._packed):
            yield

    def unwrap(self) -> torch.nn.Module:
        restore_all(self._packed)
        return super().unwrap()

    def _geometry(self, module: torch.nn.Module) -> tuple[int, torch.Tensor]:
        return 1, module.embeddings.patch_embedding.weight  # a Linear: (hidden, C*P*P)

    def _init_family(self, module: torch.nn.Module) -> None:
        self.with_last_hidden_state = True
        self.grid_side = int(module.embeddings.position_embedding_size)
        self.use_head = bool(getattr(module, "use_head", False)) and hasattr(module, "head")

    def _layout_rewrites(self, module: torch.nn.Module) -> list[Any]:
        return []  # the patch embedding is a Linear already

    def compile_regions(self) -> list[torch.nn.Module]:
        """The encoder layers: what ``compile="auto"`` compiles (once for all of them and every budget)."""
        return list(self._module.encoder.layers)

    @property
    def output_names(self) -> tuple[str, ...]:
        return ("last_hidden_state",) + (("pooler_output",) if self.use_head else ())

    # -- inputs: the padded batch, its mask and shapes
    def inputs(self, pixel_values: Any, pixel_attention_mask: Any = None, spatial_shapes: Any = None, *,
               return_dict: bool = True) -> Siglip2Inputs:
        """Validate the tower's own arguments into each image's real rows. ``spatial_shapes`` and the mask are read
        on the host (one copy each, as the tower's own checks read them); the mask must be each image's first
        ``h*w`` rows (the processor's), else :class:`UnusualMask` (an :class:`InputError`)."""
        d = self.channels

        def padded_shape(pv: torch.Tensor) -> str | None:
            if pv.dim() == 3 and pv.shape[2] == d and pv.shape[0] > 0:
                return None
            return (f"pixel_values: expected shape (images, max_patches, {d}) (each image's patch rows, zero-padded, "
                    f"as the processor gives them), got {tuple(pv.shape)}.")

        pv = check_pixels("pixel_values", pixel_values, expected=f"a torch.Tensor (images, max_patches, {d})",
                          floating="a floating-point tensor (the processor's normalised patches)",
                          device=self._device, shape=padded_shape)
        n, length = int(pv.shape[0]), int(pv.shape[1])
        shapes = _host_ints("spatial_shapes", spatial_shapes, (n, 2), "(height, width) in patches, one per image")
        if not isinstance(return_dict, bool):
            raise InputTypeError(f"return_dict: expected True or False, got {describe(return_dict)}.")
        rows = shapes.prod(1)
        bad = np.nonzero((shapes.min(1) < 1) | (rows > length))[0]
        if bad.size:
            i = int(bad[0])
            raise InputError(f"spatial_shapes: image {i} is {shapes[i].tolist()} patches; each image needs h, w >= 1 "
                             f"and h*w <= pixel_values' {length} rows.")
        if pixel_attention_mask is None:
            raise InputError("pixel_attention_mask: expected (images, max_patches), 1 on each image's first h*w "
                             "rows, got None.")
        mask = _host_ints("pixel_attention_mask", pixel_attention_mask, (n, length), "1 on each image's valid rows",
                          allow_bool=True)
        want = np.arange(length)[None, :] < rows[:, None]
        wrong = np.nonzero(((mask != 0) != want).any(1))[0]
        if wrong.size:
            i = int(wrong[0])
            raise UnusualMask(f"pixel_attention_mask: image {i} must be 1 on its first {rows[i]} rows (h*w of "
                             f"spatial_shapes {shapes[i].tolist()}) and 0 after, as the processor makes it.")
        grid = np.concatenate((np.ones((n, 1), np.int64), shapes), axis=1)
        return Siglip2Inputs(self._real_rows(pv, rows), grid, return_dict, length)

    def _real_rows(self, pv: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """Every image's first ``h*w`` rows ``(sum, C*P*P)``, images in order: a view when none is padded."""
        if (rows == pv.shape[1]).all():
            return pv.reshape(-1, pv.shape[2])
        return pv.reshape(-1, pv.shape[2]).index_select(0, self._device_index(_flat_index(rows, pv.shape[1])))

    def _device_index(self, index: np.ndarray) -> torch.Tensor:
        return to_device(torch.from_numpy(index), self._device)

    def inputs_from_call(self, *args: Any, **kwargs: Any) -> Siglip2Inputs | StockCall:
        """The tower's ``forward(pixel_values, pixel_attention_mask, spatial_shapes, **kwargs)`` as inputs.

        ``return_dict`` (default: the config's) is honoured; ``output_hidden_states`` / ``output_attentions``
        (or the config's defaults), a missing mask or one that is not each image's first ``h*w`` rows get a
        :class:`StockCall` (the tower's own forward answers). Other keywords are ignored, as the tower's
        ``**kwargs`` swallows them."""
        values = call_args.bind(f"{self.tower_class}.forward", _PARAMETERS, args, kwargs)
        config = self._module.config
        asked = call_args.recording_requested(config, kwargs)
        if asked is not None:
            return StockCall(f"{asked} requested")
        if values.get("pixel_attention_mask") is None:
            return StockCall("no pixel_attention_mask")
        return_dict = call_args.return_dict(config, kwargs)
        try:
            return self.inputs(values.get("pixel_values"), values["pixel_attention_mask"],
                               values.get("spatial_shapes"), return_dict=return_dict)
        except UnusualMask:
            return StockCall("pixel_attention_mask not each image's first h*w rows")

    # -- metadata and buffers
    def _positions(self, units: UnitGrid) -> np.ndarray:
        return np.empty((units.units, 0), dtype=np.int64)  # no rotary positions in this tower

    def _frame_tables(self, units: UnitGrid) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        sizes = units.height * units.width  # merge 1: units are patches
        pairs = [position_weights(self.grid_side, h, w) for h, w in zip(units.height.tolist(), units.width.tolist())]
        return {name: (np.concatenate([p[k] for p in pairs]), sizes) for k, name in enumerate(POSITION)}

    def _assemble(self, frames: list[dict[str, np.ndarray]], cu: np.ndarray) -> dict[str, np.ndarray]:
        return {name: np.concatenate([f[name] for f in frames]) for name in POSITION}

    def metadata(self, grid: np.ndarray) -> dict[str, np.ndarray]:
        meta = super().metadata(grid)
        del meta["position_ids"]
        return meta

    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> dict[str, BufferSpec]:
        specs = super().buffer_specs(path, budget, max_items, max_frames)
        del specs["position_ids"]
        return specs

    def _extra_buffer_specs(self, budget: int, max_frames: int) -> dict[str, BufferSpec]:
        return {name: BufferSpec((budget, self.grid_side), torch.float32, FillRule.ZERO) for name in POSITION}

    def _static_kwargs(self, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, Any]:
        return {name: buffers[name] for name in POSITION}

    # -- forwards
    def forward_static(self, path: str, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
        kwargs = {"cu_seqlens": buffers["cu_seqlens"], "max_seqlen": budget}
        kwargs.update(self._static_kwargs(buffers, budget))
        with self._engaged():
            return self._run(buffers["pixels"], budget, kwargs)

    def _run(self, pixels: torch.Tensor, tokens: int, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The tower over ``tokens`` packed rows: ``last_hidden_state`` ``(tokens, hidden)`` and, with the head,
        ``pooler_output`` ``(tokens, hidden)`` (each row holds its image's pooled vector)."""
        tower = self._module
        cu, longest = kwargs["cu_seqlens"], kwargs["max_seqlen"]
        packed = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
        with torch.no_grad():
            x = self._embed(pixels, kwargs["pos_h"], kwargs["pos_w"]).unsqueeze(0)
            for layer in tower.encoder.layers:
                x = layer(x, None, **packed)
            x = tower.post_layernorm(x[0])
            named = {"last_hidden_state": x}
            if self.use_head:
                named["pooler_output"] = self._pool(x, cu)
        return named

    def _embed(self, pixels: torch.Tensor, pos_h: torch.Tensor, pos_w: torch.Tensor) -> torch.Tensor:
        """Patch embeddings plus the resized table: 5.25's ``weights @ table.float()``, cast to the table's dtype."""
        embeddings = self._module.embeddings
        linear = embeddings.patch_embedding
        x = linear(pixels.to(linear.weight.dtype))
        table = embeddings.position_embedding.weight
        weights = (pos_h[:, :, None] * pos_w[:, None, :]).flatten(1)
        return x + (weights @ table.float()).to(table.dtype)

    def _pool(self, x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        """The head over packed rows ``x`` ``(R, hidden)``: the probe attends to each ``cu`` sequence's rows alone
        (the tower's ``key_padding_mask``), then LayerNorm and MLP with a residual; each row gets its sequence's."""
        head = self._module.head
        mha = head.attention
        rows, width = x.shape
        heads = mha.num_heads
        dim = width // heads
        wq, wk, wv = mha.in_proj_weight.chunk(3)
        bq, bk, bv = mha.in_proj_bias.chunk(3)
        q = F.linear(head.probe.reshape(1, width).to(x.dtype), wq, bq).view(heads, 1, dim)
        k = F.linear(x, wk, bk).view(rows, heads, dim).transpose(0, 1)
        v = F.linear(x, wv, bv).view(rows, heads, dim).transpose(0, 1)
        scores = (q * (1.0 / math.sqrt(dim))) @ k.transpose(1, 2)  # (heads, 1, R)
        position = torch.arange(rows, device=x.device, dtype=cu.dtype)
        inside = (position[None, :] >= cu[:-1, None]) & (position[None, :] < cu[1:, None])  # (S, R)
        # A finite floor, not -inf: an empty sequence slot then averages every row (finite, never read) instead
        # of 0/0 (rule 13: no NaN in the pool).
        floor = torch.finfo(scores.dtype).min
        probs = torch.softmax(scores.masked_fill(~inside[None], floor), dim=-1)  # (heads, S, R)
        pooled = (probs @ v).transpose(0, 1).reshape(-1, width)  # (S, hidden)
        pooled = mha.out_proj(pooled)
        pooled = pooled + head.mlp(head.layernorm(pooled))
        owner = torch.searchsorted(cu[1:], position, right=True)  # each row's sequence
        return pooled[owner]

    # -- results
    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One image's outputs: ``last_hidden_state`` ``(h*w, hidden)`` and, with the head, ``pooler_output``
        ``(hidden,)``."""
        out = dict(parts["default"])
        if "pooler_output" in out:
            out["pooler_output"] = out["pooler_output"][0]
        return out

    def output_for_call(self, results: Sequence[Mapping[str, torch.Tensor]], inputs: QwenVisionInputs) -> Any:
        """``BaseModelOutputWithPooling`` as the tower returns it: ``last_hidden_state`` ``(B, L, hidden)`` (each
        image's rows first, its padding rows zero) and ``pooler_output`` ``(B, hidden)`` or ``None``; its
        ``to_tuple()`` for ``return_dict=False``."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        inputs = self._coerce(inputs)
        rows = inputs.grid[:, 1] * inputs.grid[:, 2]
        n = inputs.n
        length = getattr(inputs, "max_patches", None) or int(rows.max())
        real = torch.cat([r["last_hidden_state"] for r in results])
        if (rows == length).all():
            last = real.reshape(n, length, -1)
        else:
            last = real.new_zeros(n * length, real.shape[-1])
            last = last.index_copy(0, self._device_index(_flat_index(rows, length)), real).view(n, length, -1)
        pooled = torch.stack([r["pooler_output"] for r in results]) if self.use_head else None
        out = BaseModelOutputWithPooling(last_hidden_state=last, pooler_output=pooled)
        return out if inputs.return_dict else out.to_tuple()


def _attention_forward(attn: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, None]]:
    """``Siglip2Attention.forward`` (transformers 5.15 to 5.25) with its keywords passed to the packed attention
    function (:func:`~encgraph.models.attention.hf_attention_forward`)."""

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
        shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        out, _ = hf_attention_forward(attn, q, k, v, attention_mask, scaling=attn.scale, **kwargs)
        return attn.out_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), None

    return forward


def _flat_index(rows: np.ndarray, length: int) -> np.ndarray:
    """The flat rows ``i * length + k`` (``k < rows[i]``) of a padded ``(n, length)`` batch, images in order."""
    owner = np.repeat(np.arange(rows.shape[0]), rows)
    first = np.concatenate(([0], np.cumsum(rows)[:-1]))
    return owner * length + np.arange(owner.shape[0]) - first[owner]


def _host_ints(name: str, value: Any, shape: tuple[int, int], what: str, allow_bool: bool = False) -> np.ndarray:
    """``value`` as an int64 host array of ``shape`` (a device tensor is copied once)."""
    array = None
    if isinstance(value, torch.Tensor) and (not value.is_floating_point() and not value.is_complex()):
        array = value.detach().cpu().numpy()
    elif isinstance(value, (Sequence, np.ndarray)) and not isinstance(value, (str, bytes)):
        try:
            array = np.asarray(value)
        except ValueError:
            array = None
    kinds = "iub" if allow_bool else "iu"
    if array is None or array.dtype.kind not in kinds or array.shape != shape:
        raise InputError(f"{name}: expected an integer {shape} tensor ({what}), got {describe(value)}.")
    return array.astype(np.int64)


def adapter(module: torch.nn.Module, **options: Any) -> Siglip2Adapter:
    """The registry factory: ``options`` are :class:`Siglip2Adapter`'s keyword arguments."""
    return Siglip2Adapter(module, **options)
