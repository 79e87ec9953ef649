"""Step-3.7's vision tower alone (``Step3p7VisionModel``), as the model calls it: ``graphed(tower)``.

``Step3p7Model.get_image_features`` calls its tower twice per batch of images: once on the global views
(``pixel_values``: ``(B, 3, 728, 728)``) and once on every image's crops (``pixel_values_local``: ``(T, 3, 504,
504)``, with ``output_hidden_states=False``). The tower answers each with ``BaseModelOutput(last_hidden_state=(N,
tokens, 4 * hidden))``: 169 tokens per global view, 81 per crop. So ``model.model.vision_model =
encgraph.graphed(model.model.vision_model)`` is the README's one line for this family too; the projector and the
per-image assembly stay the model's own code.

One item is one view. The adapter has one path per view size (``global``, ``local``; one path when both sizes are
equal), each a ladder in output tokens (multiples of a view's tokens) over a buffer of zero-padded stacked views,
and each may be empty: a call of global views puts nothing on ``local``. The static forward is
:class:`~encgraph.models.step3p7.Step3p7Adapter`'s without the projector (the rotary positions, which the tower
reads back on the host every call, computed once per path). A call whose views have another size, or that asks for
per-layer outputs or keywords the graphs do not model, is answered by the tower's own forward (a
:class:`~encgraph.models.protocol.StockCall`, counted in ``stats["eager_reasons"]``).

Per item: ``{"last_hidden_state": (tokens, 4 * hidden)}`` in the tower's dtype.

When the whole model is at hand, its ``get_image_features`` shim (:mod:`encgraph.models.step3p7`) captures the
projector with the tower and makes one runner call per batch of images instead of two.
"""

from __future__ import annotations

import collections
import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from encgraph._validate import check_int, describe
from encgraph.capture.protocol import AdapterConfig, PathSpec, StockCall
from encgraph.errors import ConfigError, InputTypeError, UnsupportedModelError
from encgraph.models._hf import require_transformers
from encgraph.models.deepseek_ocr2 import GLOBAL, LOCAL
from encgraph.models.batch_ladder import concat_parts, take_rows
from encgraph.models.step3p7 import HIDDEN, MIN_TRANSFORMERS, _Step3p7Views
from encgraph.packing import ItemSpec

__all__ = ["Step3p7TowerAdapter", "TowerViews", "adapter"]

TOWER_CLASS = "Step3p7VisionModel"


@attrs.frozen
class TowerViews:
    """The inputs of one or more tower calls: ``pixels[path]`` ``(n_path, C, S_path, S_path)`` floating point on
    the tower's device, ``paths`` the path of each item (view) in order (the ``k``-th item on a path is row ``k``
    of that path's tensor), ``return_dict`` what ``output_for_call`` returns."""

    pixels: Mapping[str, torch.Tensor]
    paths: tuple[str, ...]
    return_dict: bool = True

    def rows(self, indices: Sequence[int]) -> dict[str, list[int]]:
        """Per path, the rows of its tensor that items ``indices`` hold, in that order."""
        rank = collections.Counter()
        position = []
        for path in self.paths:
            position.append(rank[path])
            rank[path] += 1
        out: dict[str, list[int]] = {}
        for i in indices:
            out.setdefault(self.paths[i], []).append(position[i])
        return out


class Step3p7TowerAdapter(_Step3p7Views):
    """Adapter for ``Step3p7VisionModel`` (the tower without the model): ``encgraph.graphed(tower)``.

    Args:
        tower: the model's ``vision_model``; nothing is modified.
        max_images: global views in the largest global budget (default 8: a batch of 8 images).
        max_tiles: crops in the largest local budget (default 32).
        global_size, local_size: the view sides the graphs are built for; default the tower's ``image_size``
            (728) and 36 patches (504 px at patch 14), what the processor makes.
    """

    def __init__(self, tower: torch.nn.Module, *, max_images: int = 8, max_tiles: int = 32,
                 global_size: int | None = None, local_size: int | None = None) -> None:
        require_transformers(MIN_TRANSFORMERS, "the Step-3.7 tower adapter")
        if not any(c.__name__ == TOWER_CLASS for c in type(tower).__mro__):
            raise UnsupportedModelError(f"module: the Step-3.7 tower adapter takes {TOWER_CLASS}, got {describe(tower)}.")
        self.projector = None
        self._init_tower(tower, max_images, max_tiles, global_size, local_size)
        self._output_class = importlib.import_module(type(tower).__module__).BaseModelOutput
        paths = [PathSpec(GLOBAL, self.tokens[GLOBAL], self.tokens[GLOBAL] * self.max_images, allow_empty=True,
                          outputs=(HIDDEN,))]
        if self.sizes[LOCAL] != self.sizes[GLOBAL]:
            paths.append(PathSpec(LOCAL, self.tokens[LOCAL], self.tokens[LOCAL] * self.max_tiles, allow_empty=True,
                                  outputs=(HIDDEN,)))
        else:  # crops of the global size are global views
            del self.sizes[LOCAL], self.tokens[LOCAL], self._positions[LOCAL]
        self._config = AdapterConfig(paths=tuple(paths), dtype=self._dtype, device=self._device)

    @property
    def module(self) -> torch.nn.Module:
        return self.tower

    def unwrap(self) -> torch.nn.Module:
        return self.tower  # nothing was changed on the tower

    # -- inputs
    def inputs_from_call(self, pixel_values: torch.Tensor | None = None, **kwargs: Any) -> TowerViews | StockCall:
        """:class:`TowerViews` from the tower forward's own arguments, or a :class:`StockCall` for views of a size
        the graphs are not built for, per-layer outputs, or keywords the graphs do not model."""
        return_dict = self._call_keywords(kwargs, self.tower.config)
        if isinstance(return_dict, StockCall):
            return return_dict
        if not isinstance(pixel_values, torch.Tensor):
            raise InputTypeError(f"pixel_values: expected a tensor (N, {self.channels}, S, S), got {describe(pixel_values)}.")
        if pixel_values.dim() == 4 and pixel_values.shape[0] == 0:
            return StockCall("no views")
        if pixel_values.dim() != 4:  # item_specs names the expected shape
            return TowerViews({GLOBAL: pixel_values}, (GLOBAL,) * (len(pixel_values) if pixel_values.dim() else 0))
        height, width = pixel_values.shape[-2:]
        path = next((p for p, side in self.sizes.items() if (height, width) == (side, side)), None)
        if path is None:  # the tower takes any size (it interpolates its position table); the graphs hold two
            return StockCall(f"view size {height}x{width} not captured")
        return TowerViews({path: pixel_values}, (path,) * len(pixel_values), return_dict)

    def item_specs(self, inputs: TowerViews) -> list[ItemSpec]:
        """One spec per view: its tokens on its own path, none on the other; checks the views."""
        if not isinstance(inputs, TowerViews):
            raise InputTypeError(
                f"inputs: expected a TowerViews (adapter.inputs_from_call(pixel_values)), got {describe(inputs)}."
            )
        for path, views in inputs.pixels.items():
            if path not in self.sizes:
                raise ConfigError(f"inputs.pixels: expected paths {sorted(self.sizes)}, got {path!r}.")
            count = self._check_views("pixel_values", views, path)
            if count != inputs.paths.count(path):
                raise ConfigError(
                    f"inputs.paths: {inputs.paths.count(path)} items on {path!r}, but its tensor holds {count} views."
                )
        empty = dict.fromkeys(self.sizes, 0)
        return [ItemSpec({**empty, p: self.tokens[p]}) for p in inputs.paths]

    def select(self, inputs: TowerViews, indices: Sequence[int]) -> TowerViews:
        """Items ``indices``: per path a view of its views' tensor when they are consecutive, else a gather whose
        index reaches the device without a host wait (:func:`~encgraph.models.batch_ladder.take_rows`)."""
        pixels = {p: take_rows(inputs.pixels[p], r) for p, r in inputs.rows(indices).items()}
        return TowerViews(pixels, tuple(inputs.paths[i] for i in indices), inputs.return_dict)

    def sample_inputs(self, path: str, tokens: int) -> TowerViews:
        """About ``tokens // tokens_per_view`` random views (never zeros) of ``path``'s size."""
        tokens = check_int("tokens", tokens, minimum=1)
        if path not in self.tokens:
            raise ConfigError(f"path: expected one of {sorted(self.tokens)}, got {path!r}.")
        count = max(1, round(tokens / self.tokens[path]))
        side = self.sizes[path]
        views = torch.randn(count, self.channels, side, side, device=self._device).to(self._dtype)
        return TowerViews({path: views}, (path,) * count)

    def concat(self, parts: Sequence[TowerViews]) -> TowerViews:
        """One input with every part's views in order (views of both sizes may mix); part 0's ``return_dict``."""
        parts = concat_parts(parts, TowerViews)
        pixels = {
            p: torch.cat([part.pixels[p] for part in parts if p in part.pixels])
            for p in self.sizes if any(p in part.pixels for part in parts)
        }
        return TowerViews(pixels, tuple(p for part in parts for p in part.paths), parts[0].return_dict)

    # -- forwards and results
    def _pixels(self, path: str, inputs: TowerViews) -> torch.Tensor | None:
        return inputs.pixels.get(path)

    def forward_eager(self, path: str, inputs: TowerViews) -> dict[str, torch.Tensor]:
        return self._encode_views(path, inputs.pixels[path].to(self._dtype))

    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``{"last_hidden_state": (tokens, 4 * hidden)}`` of the one path the view is on."""
        (named,) = parts.values()
        return {HIDDEN: named[HIDDEN]}

    def output_for_call(self, results: list[dict[str, torch.Tensor]], inputs: TowerViews) -> Any:
        """The tower's ``BaseModelOutput`` with ``last_hidden_state`` ``(N, tokens, 4 * hidden)`` (a tuple for
        ``return_dict=False``); per-layer fields stay ``None`` as the tower leaves them when not asked for."""
        out = self._output_class(last_hidden_state=torch.stack([r[HIDDEN] for r in results]))
        return out if inputs.return_dict else out.to_tuple()

    def __repr__(self) -> str:
        return f"Step3p7TowerAdapter(sizes {self.sizes}, tokens {self.tokens}, {self._dtype}, {self._device})"


def adapter(module: torch.nn.Module, **options: Any) -> Step3p7TowerAdapter:
    """Registry factory for ``Step3p7VisionConfig``: ``Step3p7TowerAdapter(module, **options)``."""
    return Step3p7TowerAdapter(module, **options)
