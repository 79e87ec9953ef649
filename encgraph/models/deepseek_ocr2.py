"""DeepSeek-OCR2 (``transformers.models.deepseek_ocr2``): a two-path adapter, one path per kind of view.

DeepSeek-OCR2 encodes each image as one *global* view (``pixel_values``: ``(B, 3, 1024, 1024)`` by default) and
zero or more *local* tiles (``pixel_values_local``: ``(T, 3, 768, 768)``, all images' tiles stacked in image
order, ``num_local_patches[i]`` of them for image ``i``). Every view goes through the same vision tower
(``DeepseekOcr2VisionModel``: a SAM encoder, then a query encoder whose learnable queries become the view's
tokens: 256 for a 1024 px view, 144 for a 768 px one) and the ``multi_modal_projector``. The model's own
``get_image_features`` then builds image ``i``'s features as::

    cat([local features of its tiles (tiles * 144 rows, tile order), global features (256 rows), view_separator])

with no other separator or newline token (the tile grid layout does not enter the features, so the inputs
carry only tile counts). This adapter has two paths, each with its own ladder, buffers and graphs:

- ``global``: budget in output tokens, a multiple of the global view's tokens (``256 * views``); the static
  forward runs the tower and projector on a buffer of ``budget // 256`` stacked global views;
- ``local``: budget in output tokens, a multiple of ``144``; a buffer of ``budget // 144`` stacked tiles. The
  path may be empty (budget 0: an image without tiles has no local tokens).

Padding views are zero images (``FillRule.ZERO``); each view is encoded independently (attention never crosses
views), so their outputs never touch real rows, and the runner drops them. Because the planner picks a budget
per path, a batch whose tiles overflow the local ladder runs the local path eagerly while the global path still
replays.

Result per image: a tensor ``(tiles * 144 + 256 + 1, text_hidden)`` in the model's dtype, equal to
``get_image_features(...).pooler_output[i]``; it is a fresh tensor (built by ``torch.cat``) even when the runner
hands out views.

``graphed()`` does not apply: the model's ``forward`` is the language model, and the vision tower alone lacks the
projector and separator. Replace ``get_image_features`` with a thin shim instead (the adapter parses that
function's own arguments and builds its own output class)::

    import encgraph
    from encgraph.models.registry import wrap

    adapter = wrap(model)  # DeepseekOcr2ForConditionalGeneration or DeepseekOcr2Model
    runner = encgraph.EncoderGraphRunner(adapter)
    runner.capture()
    base = getattr(model, "model", model)

    def get_image_features(pixel_values, pixel_values_local=None, num_local_patches=None, **kwargs):
        inputs = adapter.inputs_from_call(pixel_values, pixel_values_local, num_local_patches, **kwargs)
        return adapter.output_for_call(runner(inputs), inputs)

    base.get_image_features = get_image_features  # model.generate(...) now encodes images through the graphs
"""

from __future__ import annotations

import importlib
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from encgraph._validate import check_int, check_pixels, describe
from encgraph.capture.protocol import AdapterConfig, BufferSpec, FillRule, PathSpec
from encgraph.errors import (
    ConfigError,
    InputError,
    InputTypeError,
    UnsupportedModelError,
)
from encgraph.models._hf import require_transformers, tower_dtype_device
from encgraph.models.deepseek_ocr2_tower import default_side, graph_safe_rel_pos, view_tokens
from encgraph.models.batch_ladder import concat_parts, take_rows
from encgraph.packing import ItemSpec

__all__ = ["DeepseekOcr2Adapter", "OcrImages", "adapter", "view_tokens"]

GLOBAL = "global"
LOCAL = "local"
OUTPUT = "features"
MIN_TRANSFORMERS = "5.17"
"""Lowest version tested (5.17 and 5.24 have the same vision tower and ``get_image_features``)."""
_MODEL_CLASSES = ("DeepseekOcr2Model", "DeepseekOcr2ForConditionalGeneration")


@attrs.frozen
class OcrImages:
    """The inputs of one call, as the model's ``get_image_features`` receives them.

    - ``pixel_values``: ``(B, 3, G, G)`` floating point, one global view per image;
    - ``pixel_values_local``: ``(T, 3, L, L)``, every image's tiles stacked in image order, or ``None`` (no tiles);
    - ``num_local_patches``: ``B`` ints, the tiles of each image (summing to ``T``).
    - ``return_dict``: what :meth:`DeepseekOcr2Adapter.output_for_call` returns (the output class or a tuple).
    """

    pixel_values: torch.Tensor
    pixel_values_local: torch.Tensor | None = None
    num_local_patches: tuple[int, ...] = attrs.field(default=(), converter=lambda v: _counts(v))
    return_dict: bool = True

    @property
    def tile_starts(self) -> np.ndarray:
        """``B + 1`` offsets of each image's first tile in ``pixel_values_local`` (host)."""
        return np.concatenate([[0], np.cumsum(np.asarray(self.num_local_patches, dtype=np.int64))]).astype(np.int64)


def _counts(value: Any) -> tuple[Any, ...]:
    # A tensor or array of counts (the processor returns a tensor with return_tensors="pt") is read on the host
    # once, as get_image_features does; the values are checked by item_specs.
    if isinstance(value, (torch.Tensor, np.ndarray)):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        value = (value,)  # item_specs then names the expected counts and what was given
    return tuple(int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) else v for v in value)


class DeepseekOcr2Adapter:
    """Two-path adapter (``global``, ``local``) for a DeepSeek-OCR2 model's image features.

    Args:
        model: ``DeepseekOcr2ForConditionalGeneration`` or ``DeepseekOcr2Model`` (its ``vision_tower``,
            ``multi_modal_projector`` and ``view_separator`` are used; nothing is modified).
        max_images: global views in the largest global budget (default 8): global ladder ``256 * (1, 2, 4, 8)``.
        max_tiles: tiles in the largest local budget (default 32): local ladder ``0, 144 * (1, 2, ..., 32)``.
        global_size, local_size: the side in pixels of a global view and of a tile; default from the query
            tables (16 x 16 and 12 x 12 queries, 4 x downsampling, the SAM patch size: 1024 and 768 px at patch
            16), as the processor makes them (its ``size`` and ``tile_size``).

    Budgets must be multiples of the path's tokens per view (``global_tokens``, ``local_tokens``); the default
    ladders are. Both forwards run under ``torch.no_grad()``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_images: int = 8,
        max_tiles: int = 32,
        global_size: int | None = None,
        local_size: int | None = None,
    ) -> None:
        require_transformers(MIN_TRANSFORMERS, "the DeepSeek-OCR2 adapter")
        names = {c.__name__ for c in type(model).__mro__}
        if not names & set(_MODEL_CLASSES):
            raise UnsupportedModelError(
                f"model: the DeepSeek-OCR2 adapter takes {' or '.join(_MODEL_CLASSES)}, got {describe(model)}."
            )
        base = model.model if "DeepseekOcr2ForConditionalGeneration" in names else model
        self.model = base
        self.tower = base.vision_tower
        self.projector = base.multi_modal_projector
        self.separator = base.view_separator
        self.max_images = check_int("max_images", max_images, minimum=1)
        self.max_tiles = check_int("max_tiles", max_tiles, minimum=1)
        self.channels = int(self.tower.config.sam_config.num_channels)
        queries = {
            GLOBAL: self.tower.query_1024_resolution.num_embeddings,
            LOCAL: self.tower.query_768_resolution.num_embeddings,
        }
        given = {GLOBAL: global_size, LOCAL: local_size}
        self.sizes = {
            path: default_side(self.tower, queries[path]) if size is None else check_int(f"{path}_size", size, minimum=1)
            for path, size in given.items()
        }
        self.tokens = {path: view_tokens(self.tower, side) for path, side in self.sizes.items()}
        self._dtype, self._device = tower_dtype_device(self.tower)
        graph_safe_rel_pos(self.tower)
        self._output_class = importlib.import_module(type(base).__module__).DeepseekOcr2ModelOutputWithPooling
        g, t = self.tokens[GLOBAL], self.tokens[LOCAL]
        self._config = AdapterConfig(
            paths=(
                PathSpec(GLOBAL, g, g * self.max_images, outputs=(OUTPUT,)),
                PathSpec(LOCAL, t, t * self.max_tiles, allow_empty=True, outputs=(OUTPUT,)),
            ),
            dtype=self._dtype,
            device=self._device,
        )

    @property
    def config(self) -> AdapterConfig:
        return self._config

    @property
    def global_tokens(self) -> int:
        """Output tokens of one global view (256 by default)."""
        return self.tokens[GLOBAL]

    @property
    def local_tokens(self) -> int:
        """Output tokens of one tile (144 by default)."""
        return self.tokens[LOCAL]

    # -- inputs
    def inputs_from_call(
        self,
        pixel_values: torch.Tensor | None = None,
        pixel_values_local: torch.Tensor | None = None,
        num_local_patches: Sequence[int] | torch.Tensor | None = None,
        **kwargs: Any,
    ) -> OcrImages:
        """:class:`OcrImages` from ``get_image_features``' own arguments (``num_local_patches`` may be a tensor,
        read on the host here as the model itself does; ``None`` means no tiles)."""
        return_dict = kwargs.pop("return_dict", None)
        for key in ("output_attentions", "output_hidden_states"):
            if kwargs.pop(key, None):
                raise InputError(
                    f"get_image_features: {key} is not supported by the graphs (only the features are captured); "
                    "call the model's own get_image_features for them."
                )
        if kwargs:
            raise InputTypeError(
                f"get_image_features: unsupported keyword arguments {sorted(kwargs)}; supported: pixel_values, "
                "pixel_values_local, num_local_patches, return_dict."
            )
        if pixel_values is None:
            raise InputTypeError("pixel_values: expected the global views (B, 3, H, W), got None.")
        if num_local_patches is None:
            if pixel_values_local is not None:
                raise InputError(
                    "num_local_patches: expected the tiles of each image when pixel_values_local is given, got None."
                )
            num_local_patches = [0] * (pixel_values.shape[0] if isinstance(pixel_values, torch.Tensor) else 0)
        return_dict = True if return_dict is None else bool(return_dict)
        return OcrImages(pixel_values, pixel_values_local, num_local_patches, return_dict)

    def _check_views(self, name: str, views: Any, path: str) -> int:
        side = self.sizes[path]
        hint = f"(N, {self.channels}, {side}, {side})"

        def views_shape(t: torch.Tensor) -> str | None:
            if t.dim() == 4 and tuple(t.shape[1:]) == (self.channels, side, side):
                return None
            return (f"{name}: expected shape {hint} (the {path} views the graphs are built for), got "
                    f"{tuple(t.shape)}; resize with the model's processor, or build the adapter with "
                    f"{path}_size={t.shape[-1] if t.dim() == 4 else '...'}.")

        check_pixels(
            name, views, expected=f"a tensor {hint}", floating="floating-point normalized pixels (run the image "
            "processor)", device=self._device, shape=views_shape, owner="model",
        )
        return int(views.shape[0])

    def item_specs(self, inputs: OcrImages) -> list[ItemSpec]:
        """One spec per image: ``{"global": global_tokens, "local": local_tokens * tiles}``; checks the inputs."""
        if not isinstance(inputs, OcrImages):
            raise InputTypeError(
                f"inputs: expected an OcrImages (adapter.inputs_from_call(pixel_values, pixel_values_local, "
                f"num_local_patches)), got {describe(inputs)}."
            )
        images = self._check_views("pixel_values", inputs.pixel_values, GLOBAL)
        tiles = 0 if inputs.pixel_values_local is None else self._check_views(
            "pixel_values_local", inputs.pixel_values_local, LOCAL
        )
        counts = inputs.num_local_patches
        if len(counts) != images or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            raise InputError(
                f"num_local_patches: expected {images} ints >= 0 (one per image of pixel_values), got "
                f"{list(counts)}."
            )
        if sum(counts) != tiles:
            raise InputError(
                f"num_local_patches: the counts sum to {sum(counts)} tiles, but pixel_values_local holds {tiles}; "
                "pass the processor's num_local_patches with its pixel_values_local."
            )
        g, t = self.tokens[GLOBAL], self.tokens[LOCAL]
        return [ItemSpec({GLOBAL: g, LOCAL: t * c}) for c in counts]

    def select(self, inputs: OcrImages, indices: Sequence[int]) -> OcrImages:
        """Images ``indices`` with their tiles: views where they are consecutive, else gathers whose index reaches
        the device without a host wait (:func:`~encgraph.models.batch_ladder.take_rows`)."""
        idx = list(indices)
        counts = tuple(inputs.num_local_patches[i] for i in idx)
        pv = inputs.pixel_values
        local = inputs.pixel_values_local
        if local is not None:
            starts = inputs.tile_starts
            rows = [r for i in idx for r in range(starts[i], starts[i + 1])]
            local = take_rows(local, rows) if rows else None
        return OcrImages(take_rows(pv, idx), local, counts, inputs.return_dict)

    def concat(self, parts: Sequence[OcrImages]) -> OcrImages:
        """One input holding every part's images in order: global views and tiles concatenated, tile counts
        joined; part 0's ``return_dict``. Parts were validated by ``item_specs``."""
        parts = concat_parts(parts, OcrImages)
        if len(parts) == 1:
            return parts[0]
        local = [p.pixel_values_local for p in parts if p.pixel_values_local is not None]
        return OcrImages(
            torch.cat([p.pixel_values for p in parts]),
            torch.cat(local) if local else None,
            tuple(c for p in parts for c in p.num_local_patches),
            parts[0].return_dict,
        )

    # -- static buffers and forwards
    def _views(self, path: str, budget: int) -> int:
        per_view = self.tokens[path]
        if budget % per_view:
            raise ConfigError(
                f"budgets[{path!r}]: expected multiples of {per_view} (the tokens of one {path} view), got {budget}; "
                f"use {per_view} * views."
            )
        return budget // per_view

    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> dict[str, BufferSpec]:
        """``pixels``: ``(budget // tokens_per_view, 3, side, side)`` in the tower's dtype, zero-padded views."""
        side = self.sizes[path]
        shape = (self._views(path, budget), self.channels, side, side)
        return {"pixels": BufferSpec(shape, self._dtype, FillRule.ZERO)}

    def _pixels(self, path: str, inputs: OcrImages) -> torch.Tensor | None:
        return inputs.pixel_values if path == GLOBAL else inputs.pixel_values_local

    def replay_values(self, path: str, inputs: OcrImages, budget: int) -> dict[str, torch.Tensor]:
        pixels = self._pixels(path, inputs)
        return {} if pixels is None else {"pixels": pixels.to(self._dtype)}

    def _encode(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        # (V, 3, S, S) -> tower queries (V, Q, hidden) -> projector (V, Q, text_hidden) -> rows (V * Q, text_hidden),
        # each view's tokens consecutive, views in order: the rows get_image_features flattens per image.
        with torch.no_grad():
            feats = self.projector(self.tower(pixels).last_hidden_state)
        return {OUTPUT: feats.reshape(-1, feats.shape[-1])}

    def forward_static(self, path: str, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
        """Tower and projector on the padded view buffer; output ``(budget, text_hidden)``. Every branch of the
        tower (query table, position-embedding interpolation, window padding) depends on shapes only."""
        return self._encode(buffers["pixels"])

    def forward_eager(self, path: str, inputs: OcrImages) -> dict[str, torch.Tensor]:
        pixels = self._pixels(path, inputs)
        if pixels is None or pixels.shape[0] == 0:
            width = self.projector.out_features
            return {OUTPUT: torch.zeros(0, width, dtype=self._dtype, device=self._device)}
        return self._encode(pixels.to(self._dtype))

    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> torch.Tensor:
        """``cat([local rows, global rows, view_separator])``, as ``get_image_features`` builds each image."""
        glob = parts[GLOBAL][OUTPUT]
        pieces = [parts[LOCAL][OUTPUT]] if LOCAL in parts else []
        with torch.no_grad():
            sep = self.separator.to(glob.device).unsqueeze(0)
            return torch.cat([*pieces, glob, sep], dim=0)

    def output_for_call(self, results: list[torch.Tensor], inputs: OcrImages) -> Any:
        """The model's ``DeepseekOcr2ModelOutputWithPooling`` with ``pooler_output`` = the per-image features (what
        the model's forward reads); the tower's hidden states are not kept by the graphs, so the other fields are
        ``None``. A tuple when the call passed ``return_dict=False``."""
        out = self._output_class(pooler_output=list(results))
        return out if inputs.return_dict else out.to_tuple()


def adapter(module: torch.nn.Module, **options: Any) -> DeepseekOcr2Adapter:
    """Registry factory: ``DeepseekOcr2Adapter(module, **options)``."""
    return DeepseekOcr2Adapter(module, **options)
