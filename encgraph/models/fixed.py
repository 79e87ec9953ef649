"""Fixed-resolution Hugging Face vision towers (SigLIP, CLIP, InternVL): one graph per batch size.

These towers take ``pixel_values (B, C, H, W)`` at one image size and give every image the same number of
tokens, so the budget unit is items (:attr:`BudgetUnit.ITEMS`): a ladder of batch sizes (default 1, 2, 4, ...,
32). A batch of ``n`` images replays the graph of the smallest batch size ``b >= n``; the ``b - n`` padding
rows of the pixel buffer are zero images (``FillRule.ZERO``), whose outputs the runner never hands out.

The static forward is the tower's own ``forward`` on the padded pixel buffer. It is graph-safe on transformers
5.17 and 5.24: attention (SDPA or eager) runs on fixed shapes with no mask, the size checks and the
``interpolate_pos_encoding`` branches compare Python ints, and nothing reads a tensor value on the host (the
tests run the static forward on the ``meta`` device, where any such read raises).

Outputs per item (rows = items, each ``(1, ...)`` in the per-item results):

- ``last_hidden_state``: ``(B, tokens, hidden)``;
- ``pooler_output``: ``(B, hidden)``, where the tower returns one (CLIP; SigLIP with its attention-pooling
  head; not InternVL, whose forward leaves it ``None``);
- ``hidden_states.<i>``: ``(B, tokens, hidden)``, index ``i`` of the tower's ``hidden_states`` tuple
  (embeddings, then each layer), for the indices the adapter captures (see ``hidden_states`` below).

``graphed(tower)`` returns the tower's own output class (``BaseModelOutputWithPooling``, or InternVL's
``InternVLVisionModelOutputWithPooling``), with every tensor concatenated over the call's images in input order,
or its ``to_tuple()`` when the call passes ``return_dict=False``.
"""

from __future__ import annotations

import importlib
import inspect
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

from encgraph._validate import check_int, check_pixels, describe
from encgraph.capture.compiling import Sizes
from encgraph.capture.protocol import BufferSpec, StockCall
from encgraph.errors import (
    ConfigError,
    ConfigTypeError,
    InputTypeError,
    UnsupportedModelError,
)
from encgraph.models._hf import repeated_blocks, require_transformers
from encgraph.models.attention import MIN_TRANSFORMERS
from encgraph.models.batch_ladder import (
    ONE_ITEM,
    BatchLadderAdapter,
    Signature,
    concat_parts,
)
from encgraph.models.hidden_choice import (
    HIDDEN,
    HiddenStatesChoice,
    _selects_full_indices,
    hidden_states_layout,
)
from encgraph.models.own_forward import own_forward
from encgraph.packing import ItemSpec

__all__ = ["FixedResolutionAdapter", "PixelBatch", "CallRequest", "hidden_states_layout"]

@attrs.frozen
class CallRequest:
    """What one call asked for besides its pixels; applies to every image of the call.

    ``hidden_layout`` describes the ``hidden_states`` tuple to return: per slot, the index into the tower's full
    tuple (``num_hidden_layers + 1`` entries), or ``None`` for a slot that holds ``None``; ``None`` itself means
    the call returns no ``hidden_states``.
    """

    return_dict: bool = True
    hidden_layout: tuple[int | None, ...] | None = None


@attrs.frozen
class PixelBatch:
    """The inputs of one call: ``pixel_values (B, C, H, W)`` (floating point, on the tower's device; row ``i``
    is image ``i``) and the call's :class:`CallRequest`."""

    pixel_values: torch.Tensor
    request: CallRequest = CallRequest()


def _pair(name: str, value: Any) -> tuple[int, int]:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value), int(value)
    if isinstance(value, Sequence) and len(value) == 2 and all(isinstance(v, numbers.Integral) for v in value):
        return int(value[0]), int(value[1])
    raise ConfigTypeError(f"{name}: expected an int or a (height, width) pair of ints, got {describe(value)}.")


class FixedResolutionAdapter(HiddenStatesChoice, BatchLadderAdapter):
    """Adapter for a fixed-resolution Hugging Face vision tower; families set the class attributes below.

    Builds on :class:`~encgraph.models.batch_ladder.BatchLadderAdapter` (a batch ladder, one zero-filled input
    buffer ``arg0`` of shape ``(budget, C, H, W)`` in the tower's dtype, batch-first outputs), adding what a
    Hugging Face tower needs: its forward's keyword arguments, named outputs (``hidden_states`` entries
    included), checks of the images against the tower's config, and its own output class.

    Args:
        module: the tower (e.g. ``model.vision_tower``); its first parameter's device and dtype are the tower's.
        max_batch: the largest batch size captured (default 32); the default ladder is 1, 2, 4, ... up to it.
        hidden_states: which entries of the tower's ``hidden_states`` tuple to capture: ``None`` (default:
            learn them from the calls that ask for hidden states before the runner allocates its buffers,
            that is before the first capture), ``"all"``, or indices (negative ones count from the end; ``()``
            captures none). With indices given, a call asking ``output_hidden_states=True`` gets ``None`` in the
            slots not captured (LLaVA on transformers 5.17 asks for all and reads one; ``[-2]`` saves the memory
            of the others). Capturing hidden states keeps them in the graph pool: ``(B, tokens, hidden)`` each.
        image_size: the image size the graphs are built for, an int or ``(height, width)``, at least one
            patch per side; default the config's. Another size than the config's interpolates the position
            embeddings as the tower does (calls must then pass ``interpolate_pos_encoding=True`` where the
            tower takes it, as the tower itself requires).

    Outputs carry no autograd history: both forwards run under ``torch.no_grad()`` (a captured graph cannot
    replay a backward pass); ``encgraph.graphed`` answers calls that ask for autograd with the tower's own
    forward.
    """

    family: ClassVar[str] = "vision tower"
    tower_class_names: ClassVar[tuple[str, ...]] = ()
    """Class names (of the tower or a base class) this adapter accepts."""
    positional: ClassVar[tuple[str, ...]] = ("pixel_values", "interpolate_pos_encoding")
    """The tower forward's positional parameters, in order."""
    interpolate_kwarg: ClassVar[str | None] = "interpolate_pos_encoding"
    """The forward's switch for position-embedding interpolation (``None``: the tower interpolates by itself)."""
    none_only: ClassVar[tuple[str, ...]] = ()
    """Forward parameters accepted only as ``None`` (per-call options the graphs do not hold)."""
    output_class_name: ClassVar[str] = "BaseModelOutputWithPooling"
    """The tower's output class, looked up in the tower's own modeling module (so it matches the version)."""
    compile_dynamic: ClassVar[Sizes] = Sizes.BATCH
    """How ``compile="auto"`` traces the layers: the batch alone symbolic, one frame for every budget
    (:attr:`encgraph.capture.compiling.Sizes.BATCH`). ``Sizes.TOP_STATIC`` (the top budget static in a second
    frame) is selectable here, not yet measured on a GPU (``benches/generic_compile.py``)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        max_batch: int = 32,
        hidden_states: str | Iterable[int] | None = None,
        image_size: int | tuple[int, int] | None = None,
    ) -> None:
        require_transformers(MIN_TRANSFORMERS, f"the {self.family} adapter")
        tower_class = next((c for c in type(module).__mro__ if c.__name__ in self.tower_class_names), None)
        if tower_class is None:
            raise UnsupportedModelError(
                f"module: the {self.family} adapter takes {' or '.join(self.tower_class_names)}, got "
                f"{describe(module)}; wrap it with encgraph.models.wrap(module) to pick its adapter."
            )
        super().__init__(module, max_batch=max_batch)
        config = module.config
        self.num_layers = int(config.num_hidden_layers)
        self.channels = int(config.num_channels)
        self.config_size = _pair("config.image_size", config.image_size)
        self.patch = _pair("config.patch_size", config.patch_size)
        self.image_size = self.config_size if image_size is None else _pair("image_size", image_size)
        # The patch convolution floors (SigLIP-so400m: 384 px at patch 14 is 27 x 27 patches), so any size of at
        # least one patch works.
        if any(s < p for s, p in zip(self.image_size, self.patch)):
            raise ConfigError(
                f"image_size: expected at least one patch {self.patch} per side, got {self.image_size}."
            )
        self.resized = self.image_size != self.config_size
        self.output_class = getattr(importlib.import_module(tower_class.__module__), self.output_class_name)
        self.has_pooler = self._has_pooler()
        self._init_hidden(hidden_states)
        self._signature = Signature(
            ((self.channels, *self.image_size),), (self._dtype,), "dict", self._output_names()
        )
        self._takes_any_keyword = any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(module.forward).parameters.values()
        )

    # -- family hooks
    def _has_pooler(self) -> bool:
        """Whether the tower's forward returns a ``pooler_output`` (CLIP always does)."""
        return True

    # -- configuration
    def _output_names(self) -> tuple[str, ...]:
        names = ["last_hidden_state"] + (["pooler_output"] if self.has_pooler else [])
        return tuple(names) + self._hidden_names()

    # -- inputs
    def inputs_from_call(self, *args: Any, **kwargs: Any) -> PixelBatch | StockCall:
        """Parse the tower forward's own arguments into a :class:`PixelBatch`; learns the hidden states a call
        asks for while the adapter may still grow its outputs (before the runner allocates its buffers).

        Any call the graphs cannot answer exactly gets a :class:`StockCall` and the tower's own forward answers it
        (and raises where the tower itself would): attentions, hidden states not captured, a per-call option of
        :attr:`none_only`, an image size, channel count or layout the graphs were not built for, an empty batch,
        arguments the tower's signature does not take. Keywords the tower's ``**kwargs`` would swallow are ignored,
        as the tower ignores them."""
        if len(args) > len(self.positional) or any(key in kwargs for key in self.positional[: len(args)]):
            return StockCall("arguments the adapter does not parse")
        kwargs = {**dict(zip(self.positional, args)), **kwargs}
        config = self._module.config
        pixel_values = kwargs.pop("pixel_values", None)
        return_dict = kwargs.pop("return_dict", None)
        return_dict = getattr(config, "return_dict", True) if return_dict is None else bool(return_dict)
        want = kwargs.pop("output_hidden_states", None)
        want = getattr(config, "output_hidden_states", False) if want is None else want
        attentions = kwargs.pop("output_attentions", None)
        if attentions or (attentions is None and getattr(config, "output_attentions", False)):
            return StockCall("output_attentions requested")
        interpolate = kwargs.pop(self.interpolate_kwarg, None) if self.interpolate_kwarg else None
        for key in self.none_only:
            if kwargs.pop(key, None) is not None:
                return StockCall(f"{key} given")
        if kwargs and not self._takes_any_keyword:
            return StockCall("keyword arguments the tower does not take")
        shape = self._unheld_shape(pixel_values, interpolate)
        if shape is not None:
            return StockCall(shape)
        layout = self._hidden_for_layout(want)
        if isinstance(layout, StockCall):
            return layout
        return PixelBatch(pixel_values, CallRequest(return_dict=return_dict, hidden_layout=layout))

    def _unheld_shape(self, pixel_values: Any, interpolate: Any) -> str | None:
        """Why the graphs do not hold these pixels (the tower answers them, or raises as it would), or ``None``."""
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 4:
            return "pixel_values not a (B, C, H, W) tensor"
        if pixel_values.shape[1] != self.channels or not pixel_values.is_floating_point():
            return "pixel_values of another channel count or dtype kind"
        size = tuple(pixel_values.shape[2:])
        if size != self.image_size:
            return f"image size {size[0]}x{size[1]} not captured"
        if self.interpolate_kwarg and self.resized and not interpolate:
            return f"{self.interpolate_kwarg} not set for graphs of another size than the config's"
        if pixel_values.shape[0] == 0:
            return "empty batch"
        if pixel_values.device != self._device:
            return "pixel_values on another device"
        return None

    def _hidden_changed(self) -> None:
        self._signature = attrs.evolve(self._signature, names=self._output_names())

    def item_specs(self, inputs: PixelBatch) -> list[ItemSpec]:
        """One spec (one item) per image; checks the images against the tower."""
        if not isinstance(inputs, PixelBatch):
            raise InputTypeError(f"inputs: expected a PixelBatch, got {describe(inputs)}.")
        shape_hint = f"(B, {', '.join(map(str, (self.channels, *self.image_size)))})"

        def image_shape(pv: torch.Tensor) -> str | None:
            if pv.dim() != 4:
                return f"pixel_values: expected 4 dims {shape_hint}, got shape {tuple(pv.shape)}."
            if pv.shape[1] != self.channels:
                return (f"pixel_values: the tower takes {self.channels} channels, got {pv.shape[1]} (shape "
                        f"{tuple(pv.shape)}, expected {shape_hint}).")
            if tuple(pv.shape[2:]) != self.image_size:
                return (f"pixel_values: the graphs are built for {self.image_size[0]}x{self.image_size[1]} images, "
                        f"got {pv.shape[2]}x{pv.shape[3]}; resize them with the model's image processor, or wrap "
                        f"with adapter_options={{'image_size': ({pv.shape[2]}, {pv.shape[3]})}}.")
            return None

        pv = check_pixels(
            "pixel_values", inputs.pixel_values, expected=f"a tensor {shape_hint}",
            floating=f"a floating-point tensor (normalized pixels, cast to the tower's {self._dtype} as the tower "
            "itself does)", dtype_fix="; run the image processor first", device=self._device, shape=image_shape,
        )
        return [ONE_ITEM] * pv.shape[0]

    def select(self, inputs: PixelBatch, indices: Sequence[int]) -> PixelBatch:
        (pixels,) = super().select((inputs.pixel_values,), indices)
        return PixelBatch(pixels, inputs.request)

    def compile_regions(self) -> list[torch.nn.Module]:
        """The encoder layers: what ``compile="auto"`` compiles, once for all of them and every batch size
        (:attr:`compile_dynamic`)."""
        return repeated_blocks(self._module)

    def sample_inputs(self, path: str, tokens: int) -> PixelBatch:
        """``tokens`` random normal images at the graphs' size, in the tower's dtype on its device."""
        n = check_int("tokens", tokens, minimum=1)
        pixels = torch.randn(n, self.channels, *self.image_size, device=self._device).to(self._dtype)
        return PixelBatch(pixels)

    def concat(self, parts: Sequence[PixelBatch]) -> PixelBatch:  # type: ignore[override]
        """One batch of every part's images in order, with part 0's :class:`CallRequest` (the request options
        do not change what the runner computes; ``output_for_call`` reads each call's own)."""
        parts = concat_parts(parts, PixelBatch)
        if len(parts) == 1:
            return parts[0]
        return PixelBatch(torch.cat([p.pixel_values for p in parts]), parts[0].request)

    # -- static buffers and forwards
    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> dict[str, BufferSpec]:
        # The runner allocates buffers (and then captures) with the outputs as they are now: stop learning.
        self.frozen = True
        return super().buffer_specs(path, budget, max_items, max_frames)

    def replay_values(self, path: str, inputs: PixelBatch, budget: int) -> dict[str, torch.Tensor]:
        return super().replay_values(path, (inputs.pixel_values,), budget)

    def forward_static(self, path: str, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
        """The tower on the padded pixel buffer ``arg0 (budget, C, H, W)``; every keyword is a host constant."""
        return self._run(buffers["arg0"])

    def forward_eager(self, path: str, inputs: PixelBatch) -> dict[str, torch.Tensor]:
        return self._run(inputs.pixel_values)

    def _run(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        kwargs: dict[str, Any] = {"return_dict": True, "output_attentions": False, "output_hidden_states": False}
        if self.held_hidden:
            # Where transformers takes full-tuple indices, ask only for those (the rest is never kept alive).
            kwargs["output_hidden_states"] = list(self.held_hidden) if _selects_full_indices() else True
        if self.resized and self.interpolate_kwarg:
            kwargs[self.interpolate_kwarg] = True
        with torch.no_grad():
            out = own_forward(self._module)(pixel_values=pixel_values, **kwargs)
        named = {"last_hidden_state": out.last_hidden_state}
        if self.has_pooler:
            named["pooler_output"] = out.pooler_output
        for i in self.held_hidden:
            named[f"{HIDDEN}{i}"] = out.hidden_states[i]
        return named

    def output_for_call(self, results: list[dict[str, torch.Tensor]], inputs: PixelBatch) -> Any:
        """The tower's own output class (or its ``to_tuple()`` for ``return_dict=False``), each tensor
        concatenated over the call's images in input order."""
        return self.output_for_rows({name: torch.cat([r[name] for r in results]) for name in self._signature.names},
                                    inputs)

    def output_for_rows(self, cat: Mapping[str, torch.Tensor], inputs: PixelBatch) -> Any:
        """The same from each output over the call's images (``runner.call_rows``)."""
        hidden = self._hidden_tuple(cat, inputs.request.hidden_layout)
        out = self.output_class(
            last_hidden_state=cat["last_hidden_state"], pooler_output=cat.get("pooler_output"), hidden_states=hidden
        )
        return out if inputs.request.return_dict else out.to_tuple()
