"""The inputs of the Qwen-VL vision towers and of the packed-grid families built on them
(:mod:`encgraph.models.qwen_vl`): :class:`QwenVisionInputs`, and the adapter's part that validates the tower's
call arguments, describes items for the planner, and takes sub-batches (:class:`QwenInputsMixin`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import numpy as np
import torch

from encgraph._validate import check_int, check_pixels, describe
from encgraph.errors import InputError, InputTypeError
from encgraph.models import call_args
from encgraph.models.call_args import RECORDING_SWITCHES
from encgraph.models.protocol import StockCall
from encgraph.models.qwen_grid import grid_array as _grid_array
from encgraph.packing import ItemSpec

__all__ = ["QwenVisionInputs", "QwenInputsMixin", "RECORDING_SWITCHES"]


@attrs.frozen(eq=False)
class QwenVisionInputs:
    """Validated inputs of a Qwen-VL tower.

    Attributes:
        pixel_values: ``(rows, C*T*P*P)`` floating tensor on the tower's device (cast to the tower's dtype when
            copied into the static buffer, as the tower's patch embedding does).
        grid: ``(n, 3)`` int64 numpy array on the host, ``(t, h, w)`` per item in patches.
        return_dict: the caller's ``return_dict`` (``False``: ``output_for_call`` returns a tuple).
        row_starts: ``(n + 1,)`` int64, the first patch row of each item, then the total.
    """

    pixel_values: torch.Tensor
    grid: np.ndarray
    return_dict: bool = True
    row_starts: np.ndarray = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        rows = self.grid[:, 0] * self.grid[:, 1] * self.grid[:, 2]
        object.__setattr__(self, "row_starts", np.concatenate(([0], np.cumsum(rows))))

    @property
    def n(self) -> int:
        return int(self.grid.shape[0])


class QwenInputsMixin:
    """The inputs half of :class:`~encgraph.models.qwen_vl.QwenVisionAdapter`: validation of
    ``(pixel_values, grid_thw)`` and of the tower's call arguments, item specs, sub-batches and sample inputs.

    Reads what the adapter sets up: the family's class facts below, and from ``__init__`` ``merge``, ``channels``,
    ``patch_shape``, ``row_shape``, ``with_last_hidden_state``, ``_module``, ``_dtype``, ``_device`` and
    ``_specs`` (the item-spec cache).
    """

    tower_class: ClassVar[str]
    call_names: ClassVar[tuple[str, str]]
    flat_rows: ClassVar[bool]
    clip_attention: ClassVar[bool]
    merge: int
    channels: int
    patch_shape: tuple[int, ...]
    row_shape: tuple[int, ...]
    with_last_hidden_state: bool
    _module: torch.nn.Module
    _dtype: torch.dtype
    _device: torch.device
    _specs: dict[tuple[int, int], ItemSpec]

    def inputs(self, pixel_values: Any, grid_thw: Any, *, return_dict: bool = True) -> QwenVisionInputs:
        """Validate ``(pixel_values, grid_thw)`` (the tower's own arguments) into :class:`QwenVisionInputs`.

        Reads ``grid_thw`` on the host (a device tensor is copied once, as the tower itself does).
        """
        def rows_shape(pv: torch.Tensor) -> str | None:
            if tuple(pv.shape[1:]) == self.row_shape:
                return None
            return (f"pixel_values: expected shape (rows, {', '.join(map(str, self.row_shape))}){self._row_hint()}, "
                    f"got {tuple(pv.shape)}; pass the processor's patches.")

        check_pixels(
            "pixel_values", pixel_values, expected=f"a torch.Tensor (rows, {self.channels})",
            floating="a floating-point tensor (the processor's normalised patches)", device=self._device,
            shape=rows_shape,
        )
        grid = _grid_array(grid_thw)
        if grid[:, 1:].min() < 1 or grid[:, 0].min() < 1:
            raise InputError(f"grid_thw: every t, h, w must be >= 1, got {grid.tolist()}.")
        bad = np.nonzero((grid[:, 1] % self.merge) | (grid[:, 2] % self.merge))[0]
        if bad.size:
            raise InputError(
                f"grid_thw: h and w must be multiples of the spatial merge size {self.merge}; item {int(bad[0])} "
                f"has {grid[bad[0]].tolist()}."
            )
        rows = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
        if rows != pixel_values.shape[0]:
            raise InputError(
                f"pixel_values: grid_thw {grid.tolist() if grid.shape[0] <= 8 else f'of {grid.shape[0]} items'} "
                f"needs sum(t*h*w) = {rows} patch rows, got {pixel_values.shape[0]}; pixel_values and grid_thw must "
                "describe the same items."
            )
        if not isinstance(return_dict, bool):
            raise InputTypeError(f"return_dict: expected True or False, got {describe(return_dict)}.")
        return QwenVisionInputs(pixel_values, grid, return_dict)

    def _row_hint(self) -> str:
        if len(self.patch_shape) == 4 and self.flat_rows:
            c, t, p, q = self.patch_shape
            return f" = (rows, channels {c} * temporal patch {t} * patch {p} * {q}), flattened"
        return ""

    def _coerce(self, inputs: Any) -> QwenVisionInputs:
        if isinstance(inputs, QwenVisionInputs):
            return inputs
        if isinstance(inputs, tuple) and len(inputs) == 2:
            return self.inputs(*inputs)
        raise InputTypeError(
            f"inputs: expected QwenVisionInputs (adapter.inputs(pixel_values, grid_thw)) or a tuple "
            f"(pixel_values, grid_thw), got {describe(inputs)}."
        )

    def inputs_from_call(self, *args: Any, **kwargs: Any) -> QwenVisionInputs | StockCall:
        """The tower's ``forward(hidden_states, grid_thw, **kwargs)`` arguments as inputs.

        ``return_dict`` (default: the config's) is honoured. A call asking for per-layer outputs
        (``output_hidden_states`` / ``output_attentions`` true, or the config's defaults true) gets a
        :class:`StockCall`: the tower's own forward answers it. Every other keyword is accepted and ignored, as
        the tower's ``**kwargs`` swallows it (``use_cache`` from ``generate()``; the metadata a model precomputes
        from ``grid_thw``, which encgraph computes itself).
        """
        names = self.call_names
        values = call_args.bind(f"{self.tower_class}.forward", names, args, kwargs)
        if values.get(names[0]) is None or values.get(names[1]) is None:
            raise InputTypeError(
                f"{self.tower_class}.forward: expected {names[0]} (pixel rows) and {names[1]}, got "
                f"{sorted(k for k, v in values.items() if v is not None)}; a graphed tower derives all its metadata "
                "from grid_thw."
            )
        config = getattr(self._module, "config", None)
        asked = call_args.recording_requested(config, kwargs)
        if asked is not None:
            return StockCall(f"{asked} requested")
        return_dict = call_args.return_dict(config, kwargs)
        if return_dict is False and not self.with_last_hidden_state:
            raise InputError(
                "return_dict=False: the tower's tuple starts with last_hidden_state, which this adapter was built "
                "without (last_hidden_state=False); wrap with the default, or use return_dict=True."
            )
        return self.inputs(values[names[0]], values[names[1]], return_dict=return_dict)

    def sample_inputs(self, path: str, tokens: int) -> QwenVisionInputs:
        """One random image of at most ``tokens`` output tokens (``a x c`` merged tokens, ``a = isqrt(tokens)``),
        normal pixel rows in the tower's dtype on its device."""
        tokens = check_int("tokens", tokens, minimum=1)
        a = math.isqrt(tokens)
        c = tokens // a
        grid = np.array([[1, a * self.merge, c * self.merge]], dtype=np.int64)
        pixels = torch.randn(int(grid.prod()), *self.row_shape, device=self._device).to(self._dtype)
        return QwenVisionInputs(pixels, grid)

    def item_specs(self, inputs: Any) -> list[ItemSpec]:
        """One spec per item: ``t*h*w / merge^2`` tokens, ``t`` frames, ``t*h*w`` input rows."""
        inputs = self._coerce(inputs)
        g = inputs.grid
        rows = (g[:, 0] * g[:, 1] * g[:, 2]).tolist()
        # ItemSpec validates on construction (a few us each); equal items share one frozen spec.
        cache = self._specs
        if len(cache) > 4096:
            cache.clear()
        out = []
        for r, t in zip(rows, g[:, 0].tolist()):
            spec = cache.get((r, t))
            if spec is None:
                spec = cache[(r, t)] = ItemSpec(r // self.merge**2, frames=1 if self.clip_attention else t, input_size=r)
            out.append(spec)
        return out

    def select(self, inputs: Any, indices: Sequence[int]) -> QwenVisionInputs:
        """The sub-batch of items ``indices``: a view of the pixel rows when they are one run, else a copy."""
        inputs = self._coerce(inputs)
        idx = list(indices)
        starts = inputs.row_starts
        first, n = idx[0], len(idx)
        if idx == list(range(first, first + n)):
            pixels = inputs.pixel_values[int(starts[first]) : int(starts[first + n])]
        else:
            pixels = torch.cat([inputs.pixel_values[int(starts[i]) : int(starts[i + 1])] for i in idx])
        return QwenVisionInputs(pixels, inputs.grid[idx], inputs.return_dict)

    def concat(self, parts: Sequence[Any]) -> QwenVisionInputs:
        """One input holding every part's items in order: pixel rows concatenated, grids stacked; part 0's
        ``return_dict`` (``output_for_call`` reads each call's own). Parts were validated by ``item_specs``."""
        from encgraph.models.batch_ladder import concat_parts

        parts = [self._coerce(p) for p in concat_parts(parts, (QwenVisionInputs, tuple))]
        if len(parts) == 1:
            return parts[0]
        pixels = torch.cat([p.pixel_values for p in parts])
        return QwenVisionInputs(pixels, np.concatenate([p.grid for p in parts]), parts[0].return_dict)
