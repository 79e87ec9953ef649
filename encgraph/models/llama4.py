"""Llama 4 vision towers (``Llama4VisionModel``, config ``Llama4VisionConfig``): fixed-size tiles (336 px in the
released models), batch-first,
on the fixed-resolution batch ladder of :mod:`encgraph.models.fixed`.

The processor cuts each image into tiles of ``image_size`` px (plus a global view) and stacks them as
``pixel_values (tiles, 3, S, S)``: a tile is an item. The tower's forward is graph-safe as it is (transformers
5.17 and 5.24): an unfold patch embedding, a class token, fixed learned and rotary position tables, attention on
fixed shapes with no mask, and a pixel-shuffle MLP; nothing reads a tensor on the host (the tests run the static
forward on the ``meta`` device).

Outputs: ``BaseModelOutputWithPooling`` with ``last_hidden_state`` ``(B, (S/P)^2 / 4, vision_output_dim)`` (after
the pixel shuffle; no ``pooler_output``, as the tower) and, where asked for and captured, ``hidden_states``
(the input of each layer and the last layer's output, ``(B, (S/P)^2 + 1, hidden)``: before ``layernorm_post``).
The tower reads ``output_hidden_states`` as a flag: any truthy value means the whole tuple, so the adapter does too.
"""

from __future__ import annotations

import numbers
from typing import Any, ClassVar

import torch

from encgraph.errors import ConfigError
from encgraph.models.fixed import FixedResolutionAdapter

__all__ = ["Llama4VisionAdapter", "adapter"]


class Llama4VisionAdapter(FixedResolutionAdapter):
    """Adapter for ``transformers.Llama4VisionModel`` (options: see
    :class:`~encgraph.models.fixed.FixedResolutionAdapter`)."""

    family: ClassVar[str] = "Llama 4"
    tower_class_names: ClassVar[tuple[str, ...]] = ("Llama4VisionModel",)
    positional: ClassVar[tuple[str, ...]] = (
        "pixel_values", "attention_mask", "output_attentions", "output_hidden_states", "return_dict",
    )
    interpolate_kwarg: ClassVar[str | None] = None
    none_only: ClassVar[tuple[str, ...]] = ("attention_mask",)

    def __init__(self, module: torch.nn.Module, **options: Any) -> None:
        super().__init__(module, **options)
        if self.resized:
            raise ConfigError(
                f"image_size: the {self.family} tower's position and rotary tables are built for its config's "
                f"{self.config_size[0]}x{self.config_size[1]} tiles, got {self.image_size}; leave image_size unset."
            )

    def _has_pooler(self) -> bool:
        return False

    def inputs_from_call(self, *args: Any, **kwargs: Any) -> Any:
        slot = self.positional.index("output_hidden_states")
        if len(args) > slot:
            args = (*args[:slot], _as_flag(args[slot]), *args[slot + 1 :])
        if "output_hidden_states" in kwargs:
            kwargs["output_hidden_states"] = _as_flag(kwargs["output_hidden_states"])
        return super().inputs_from_call(*args, **kwargs)


def _as_flag(value: Any) -> Any:
    # The tower tests the value's truth only, so an index or a list of indices (valid for other towers) means all;
    # anything else is left for the shared check to reject.
    ints = (numbers.Integral,)
    if isinstance(value, ints) or (isinstance(value, (list, tuple)) and all(isinstance(v, ints) for v in value)):
        return bool(value)
    return value


def adapter(module: torch.nn.Module, **options: Any) -> Llama4VisionAdapter:
    """The registry factory: ``options`` are :class:`Llama4VisionAdapter`'s keyword arguments."""
    return Llama4VisionAdapter(module, **options)
