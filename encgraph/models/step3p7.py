"""Step-3.7 (``transformers.models.step3p7``, transformers' representative of Step3-VL): two paths, global views and
local crops.

The processor turns each image into one *global* view (``pixel_values``: ``(B, 3, 728, 728)``) and zero or more
*local* crops (``pixel_values_local``: ``(T, 3, 504, 504)``, every image's crops stacked in image order,
``num_local_patches[i]`` of them for image ``i``). Every view goes through the same tower (``Step3p7VisionModel``:
patch embedding, 2-D rotary ViT layers, two stride-2 convolutions: ``(side / 14 / 4)^2`` tokens of width
``4 * hidden``, 169 for a global view and 81 for a crop) and the ``multi_modal_projector``. The model's own
``get_image_features`` then builds image ``i``'s features as::

    cat([projected rows of its crops (crops * 81, crop order), projected rows of its global view (169)])

and returns them as ``pooler_output`` (a list), with the global views' tower output as ``last_hidden_state``
``(B, 169, 4 * hidden)``. The grid layout and newline tokens live in the prompt, not in the features.

The tower's forward cannot be captured: it builds its rotary positions with ``torch.tensor(grid)`` on the device
and ``get_vision_position_ids``, which reads the grid back with ``.tolist()``. A view's positions depend on its
size only, so this adapter computes them once per path on the host (with that same function, on a CPU grid) and
keeps them on the device; its static forward is the tower's own modules (embeddings with the position table
interpolated for 504 px crops, layers, downsamplers) and the projector, on a buffer of stacked views. It reuses
DeepSeek-OCR2's two-path design (:class:`~encgraph.models.deepseek_ocr2.DeepseekOcr2Adapter`: the same inputs,
checks, buffers of zero-padded views and per-path budgets in output tokens, multiples of a view's tokens):

- ``global``: ``budget // 169`` views, outputs the projected rows and the tower's rows (``last_hidden_state``);
- ``local``: ``budget // 81`` crops, projected rows only; may be empty (an image without crops).

A batch whose crops overflow the local ladder runs that path eagerly while the global path still replays.
Result per image: ``{"features": (crops * 81 + 169, text_hidden), "last_hidden_state": (169, 4 * hidden)}``.

``graphed(model)`` cannot stand in (the model's ``forward`` is the language model), but ``graphed(vision_model)`` can
(:mod:`encgraph.models.step3p7_tower`: the tower as the model calls it, global views then crops). This adapter
also captures the projector and needs one runner call per batch of images: replace ``get_image_features`` with
the adapter's shim, which answers calls the graphs do not model (``output_hidden_states``, ``output_attentions``,
unknown keywords) with the model's own function::

    import encgraph
    from encgraph.models.registry import wrap

    adapter = wrap(model)  # Step3p7ForConditionalGeneration or Step3p7Model
    runner = encgraph.EncoderGraphRunner(adapter)
    runner.capture()
    adapter.model.get_image_features = adapter.shim(runner)  # generate(...) now encodes images through the graphs
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from encgraph._validate import check_int, describe
from encgraph.capture.protocol import AdapterConfig, PathSpec
from encgraph.errors import ConfigError, UnsupportedModelError
from encgraph.models._hf import repeated_blocks, require_transformers, tower_dtype_device
from encgraph.models.deepseek_ocr2 import GLOBAL, LOCAL, OUTPUT, DeepseekOcr2Adapter, OcrImages
from encgraph.models.deepseek_ocr2_tower import sam_grid
from encgraph.models.protocol import StockCall

__all__ = ["Step3p7Adapter", "adapter", "view_tokens"]

HIDDEN = "last_hidden_state"
MIN_TRANSFORMERS = "5.17"
"""Lowest version tested (5.17 and 5.24 share the tower's forward; the rotary layout differs and is the tower's)."""
_MODEL_CLASSES = ("Step3p7Model", "Step3p7ForConditionalGeneration")
_IGNORED = frozenset({"use_cache", "num_items_in_batch", "output_router_logits"})


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``Step3p7Model`` of ``model`` (itself, or a ``Step3p7ForConditionalGeneration``'s ``.model``)."""
    kinds = {c.__name__ for c in type(model).__mro__} & set(_MODEL_CLASSES)
    if not kinds:
        raise UnsupportedModelError(
            f"model: the Step-3.7 adapter takes {' or '.join(_MODEL_CLASSES)}, got {describe(model)}."
        )
    return model.model if "Step3p7ForConditionalGeneration" in kinds else model


def view_tokens(side: int, patch: int) -> int:
    """Output tokens of one ``side x side`` view: ``side // patch`` patches a side, halved (ceiling) by each of the
    two stride-2, padding-1 convolutions. ``view_tokens(728, 14) == 169``, ``view_tokens(504, 14) == 81``."""
    return sam_grid(side, patch) ** 2


class _Step3p7Views(DeepseekOcr2Adapter):
    """What both Step-3.7 adapters share: the tower's view geometry (``sizes``, ``tokens`` per path), the rotary
    positions computed once per path, and the static forward on a buffer of stacked views (with the projector
    when the adapter has one: ``self.projector``). The view buffers and checks are DeepSeek-OCR2's."""

    projector: torch.nn.Module | None

    def _init_tower(self, tower: torch.nn.Module, max_images: int, max_tiles: int, global_size: int | None,
                    local_size: int | None) -> None:
        # The tower's geometry, shared with the tower-only adapter (encgraph.models.step3p7_tower).
        self.tower = tower
        config = tower.config
        self.patch = int(config.patch_size)
        self.max_images = check_int("max_images", max_images, minimum=1)
        self.max_tiles = check_int("max_tiles", max_tiles, minimum=1)
        self.channels = int(config.num_channels)
        given = {GLOBAL: (global_size, int(config.image_size)), LOCAL: (local_size, 36 * self.patch)}
        self.sizes = {
            path: default if size is None else check_int(f"{path}_size", size, minimum=self.patch)
            for path, (size, default) in given.items()
        }
        self.tokens = {path: view_tokens(side, self.patch) for path, side in self.sizes.items()}
        self._dtype, self._device = tower_dtype_device(tower)
        self._positions = {path: self._rotary_positions(side) for path, side in self.sizes.items()}

    def compile_regions(self) -> list[torch.nn.Module]:
        """The vision tower's encoder layers: what ``compile="auto"`` compiles, once for every layer, budget and
        path. Without them the whole static forward (47 layers at the released depth) was compiled per path:
        more than 200 s for the first local graph on an H200."""
        return repeated_blocks(self.tower)

    def _rotary_positions(self, side: int) -> torch.Tensor:
        # The host read the tower does on every call, done once: (g * g, 2) int64 (row, col) positions on the device.
        from transformers.vision_utils import get_vision_position_ids

        g = side // self.patch
        return get_vision_position_ids(torch.tensor([[1, g, g]]), spatial_merge_size=1).to(self._device)

    def _encode_views(self, path: str, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        # (V, 3, S, S) -> the tower's modules with precomputed rotary positions -> (V, T, 4 * hidden) -> projector
        # (V, T, text_hidden); rows (V * T, .), each view's tokens consecutive, views in order.
        tower = self.tower
        g = self.sizes[path] // self.patch
        with torch.no_grad():
            hidden = tower.pre_layernorm(tower.embeddings(pixels, interpolate_pos_encoding=True))
            rope = tower.rotary_emb(hidden, self._positions[path])
            for layer in tower.layers:
                hidden = layer(hidden, position_embeddings=rope)
            views, _, channels = hidden.shape
            hidden = hidden.permute(0, 2, 1).view(views, channels, g, g)
            last = tower.downsampler2(tower.downsampler1(hidden)).flatten(2).permute(0, 2, 1)
            if self.projector is None:  # the tower alone: its own output rows
                return {HIDDEN: last.reshape(-1, last.shape[-1])}
            feats = self.projector(last)
        out = {OUTPUT: feats.reshape(-1, feats.shape[-1])}
        if path == GLOBAL:
            out[HIDDEN] = last.reshape(-1, last.shape[-1])
        return out

    def forward_static(self, path: str, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
        """Tower and projector on the padded view buffer: outputs ``(budget, .)``; nothing reads a value on the host."""
        return self._encode_views(path, buffers["pixels"])

    def _call_keywords(self, kwargs: dict[str, Any], config: Any) -> bool | StockCall:
        """A call's ``return_dict`` (``config``'s where not given; ``kwargs`` is emptied of what is read), or a
        :class:`StockCall` for per-layer outputs (asked for, or the tower config's default) or for keywords the
        graphs do not model (those in :data:`_IGNORED` change nothing)."""
        return_dict = kwargs.pop("return_dict", None)
        return_dict = getattr(config, "return_dict", True) if return_dict is None else bool(return_dict)
        for name in ("output_hidden_states", "output_attentions"):
            value = kwargs.pop(name, None)
            if getattr(self.tower.config, name, False) if value is None else value:
                return StockCall(f"{name} requested")
        unknown = sorted(k for k in kwargs if k not in _IGNORED)
        if unknown:
            return StockCall(f"keyword arguments {unknown}")
        return return_dict


class Step3p7Adapter(_Step3p7Views):
    """Two-path adapter (``global``, ``local``) for a Step-3.7 model's image features.

    Args:
        model: ``Step3p7ForConditionalGeneration`` or ``Step3p7Model`` (its ``vision_model`` and
            ``multi_modal_projector`` are used; nothing is modified).
        max_images: global views in the largest global budget (default 8: ladder ``169 * (1, 2, 4, 8)``).
        max_tiles: crops in the largest local budget (default 32: ladder ``0, 81 * (1, 2, ..., 32)``).
        global_size, local_size: the side in pixels of a global view and of a crop; default the tower's
            ``image_size`` (728) and 36 patches (504 px at patch 14), the processor's ``size`` and ``patch_size``.

    Both forwards run under ``torch.no_grad()``; the tower keeps its own attention implementation (every view is
    one dense sequence of the same length).
    """

    def __init__(self, model: torch.nn.Module, *, max_images: int = 8, max_tiles: int = 32,
                 global_size: int | None = None, local_size: int | None = None) -> None:
        require_transformers(MIN_TRANSFORMERS, "the Step-3.7 adapter")
        self.model = base = _base_model(model)
        self.projector: torch.nn.Module | None = base.multi_modal_projector
        self._init_tower(base.vision_model, max_images, max_tiles, global_size, local_size)
        self._stock = type(base).get_image_features.__get__(base)
        self.stock_calls: collections.Counter[str] = collections.Counter()
        g, t = self.tokens[GLOBAL], self.tokens[LOCAL]
        self._config = AdapterConfig(
            paths=(
                PathSpec(GLOBAL, g, g * self.max_images, outputs=(OUTPUT, HIDDEN)),
                PathSpec(LOCAL, t, t * self.max_tiles, allow_empty=True, outputs=(OUTPUT,)),
            ),
            dtype=self._dtype,
            device=self._device,
        )

    # -- inputs
    def inputs_from_call(
        self,
        pixel_values: torch.Tensor | None = None,
        pixel_values_local: torch.Tensor | None = None,
        num_local_patches: Sequence[int] | torch.Tensor | None = None,
        **kwargs: Any,
    ) -> OcrImages | StockCall:
        """:class:`OcrImages` from ``get_image_features``' own arguments, or a :class:`StockCall` for per-layer
        outputs or keywords the graphs do not model."""
        return_dict = self._call_keywords(kwargs, self.model.config)
        if isinstance(return_dict, StockCall):
            return return_dict
        return super().inputs_from_call(pixel_values, pixel_values_local, num_local_patches, return_dict=return_dict)

    def sample_inputs(self, path: str, tokens: int) -> OcrImages:
        """Random views (never zeros): about ``tokens // 169`` images without crops on ``global``; one image with
        about ``tokens // 81`` crops on ``local``."""
        tokens = check_int("tokens", tokens, minimum=1)
        if path not in self.tokens:
            raise ConfigError(f"path: expected {GLOBAL!r} or {LOCAL!r}, got {path!r}.")
        count = max(1, round(tokens / self.tokens[path]))
        images, crops = (count, 0) if path == GLOBAL else (1, count)

        def views(n: int, side: int) -> torch.Tensor:
            return torch.randn(n, self.channels, side, side, device=self._device).to(self._dtype)

        local = views(crops, self.sizes[LOCAL]) if crops else None
        return OcrImages(views(images, self.sizes[GLOBAL]), local, [crops] * images)

    def concat(self, parts: Sequence[OcrImages]) -> OcrImages:
        """One call with every part's images (and their crops) in order."""
        locals_ = [p.pixel_values_local for p in parts if p.pixel_values_local is not None]
        return OcrImages(
            torch.cat([p.pixel_values for p in parts]),
            torch.cat(locals_) if locals_ else None,
            [c for p in parts for c in p.num_local_patches],
            parts[0].return_dict,
        )

    # -- forwards
    def forward_eager(self, path: str, inputs: OcrImages) -> dict[str, torch.Tensor]:
        return self._encode_views(path, self._pixels(path, inputs).to(self._dtype))

    # -- results
    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``{"features": cat([crop rows, global rows]), "last_hidden_state": global tower rows}``, as
        ``get_image_features`` builds each image."""
        glob = parts[GLOBAL]
        pieces = [parts[LOCAL][OUTPUT]] if LOCAL in parts else []
        return {OUTPUT: torch.cat([*pieces, glob[OUTPUT]]), HIDDEN: glob[HIDDEN]}

    def output_for_call(self, results: list[dict[str, torch.Tensor]], inputs: OcrImages) -> Any:
        """``BaseModelOutputWithPooling`` as ``get_image_features`` returns it: ``last_hidden_state`` ``(B, 169,
        4 * hidden)`` of the global views, ``pooler_output`` the per-image features (a list); a tuple for
        ``return_dict=False``."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        out = BaseModelOutputWithPooling(
            last_hidden_state=torch.stack([r[HIDDEN] for r in results]), pooler_output=[r[OUTPUT] for r in results]
        )
        return out if inputs.return_dict else out.to_tuple()

    def shim(self, runner: Any) -> Callable[..., Any]:
        """A drop-in for the model's ``get_image_features``: the graphs through ``runner``, or the model's own
        function for a :class:`StockCall` (counted in ``stock_calls``)."""

        def get_image_features(*args: Any, **kwargs: Any) -> Any:
            inputs = self.inputs_from_call(*args, **kwargs)
            if isinstance(inputs, StockCall):
                self.stock_calls[inputs.reason] += 1
                return self._stock(*args, **kwargs)
            return self.output_for_call(runner(inputs), inputs)

        return get_image_features

    def __repr__(self) -> str:
        return f"Step3p7Adapter(sizes {self.sizes}, tokens {self.tokens}, {self._dtype}, {self._device})"


def adapter(module: torch.nn.Module, **options: Any) -> Step3p7Adapter:
    """Registry factory: ``Step3p7Adapter(module, **options)``."""
    return Step3p7Adapter(module, **options)
