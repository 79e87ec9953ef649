"""Which entries of a Hugging Face tower's ``hidden_states`` tuple an adapter captures, and what a call's
``output_hidden_states`` asks of them: shared by the fixed-resolution towers (:mod:`encgraph.models.fixed`) and
Pixtral (:mod:`encgraph.models.pixtral`).

The tuple has ``num_layers + 1`` entries: the first layer's input (the embeddings), then each layer's output. An
adapter captures some of them as named outputs ``hidden_states.<i>``; with no choice given it learns them from the
calls that ask for hidden states until the runner allocates its buffers (the first capture), then stops.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from encgraph._validate import describe
from encgraph.errors import ConfigError, ConfigTypeError, InputTypeError
from encgraph.models.protocol import StockCall

__all__ = ["HIDDEN", "HiddenStatesChoice", "hidden_states_layout"]

HIDDEN = "hidden_states."
"""Prefix of the named outputs that hold entries of the tower's ``hidden_states`` tuple."""


def _selects_full_indices() -> bool:
    # transformers changed what an index list in `output_hidden_states` means: 5.15 and 5.16 read it as a flag
    # (every hidden state), 5.17 as layer outputs (no initial embedding state, one slot per layer); later versions
    # (5.24 has it) as indices into the full tuple, negative ones allowed, resolved by this helper.
    from transformers.utils import output_capturing

    return hasattr(output_capturing, "resolve_hidden_states_indices")


def _selects_layer_outputs() -> bool:
    # 5.17 and later read an index list as layer outputs (measured: 5.15.1 and 5.16.1 return every hidden state
    # for output_hidden_states=[1], as for True).
    from encgraph.models._hf import _parse, transformers_version

    return _parse(transformers_version() or "0") >= (5, 17)


def hidden_states_layout(value: Any, num_layers: int) -> tuple[int | None, ...] | None:
    """The ``hidden_states`` tuple the installed transformers returns for ``output_hidden_states=value``, as
    indices into the full tuple (``num_layers + 1`` entries: embeddings, then each layer's output), ``None`` in
    slots it leaves ``None``; ``None`` when it returns no ``hidden_states`` at all.

    >>> hidden_states_layout(True, 2)
    (0, 1, 2)
    >>> hidden_states_layout(False, 2) is None
    True
    """
    if not value:
        return None
    full = num_layers + 1
    if isinstance(value, bool):
        return tuple(range(full))
    as_list = isinstance(value, (list, tuple, set, frozenset))
    chosen = list(value) if as_list else [value]
    if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in chosen):
        raise InputTypeError(
            f"output_hidden_states: expected True, False, an int or a list of ints (hidden-state indices), got "
            f"{describe(value)}."
        )
    if _selects_full_indices():
        picked = {int(i) % full for i in chosen if -full <= i < full}
        return tuple(i if i in picked else None for i in range(full))
    if as_list and _selects_layer_outputs():
        return tuple(j + 1 if j in set(chosen) else None for j in range(num_layers))
    return tuple(range(full))  # 5.17 reads a lone int as a flag; 5.15 and 5.16 read any truthy value as one


class HiddenStatesChoice:
    """The captured ``hidden_states`` entries of an adapter (a mixin): ``held_hidden`` (sorted indices into the full
    tuple), whether they are still learned from calls (``learn_hidden``, until ``frozen``), and the tuple a call
    gets. The adapter sets ``num_layers`` and calls :meth:`_init_hidden`; it freezes the choice (``frozen =
    True``) when the runner asks for its buffers."""

    num_layers: int
    tied_last: bool = False
    """The last entry is the tower's ``last_hidden_state`` itself (no final norm): never captured twice."""

    def _init_hidden(self, hidden_states: str | Iterable[int] | None) -> None:
        self.learn_hidden = hidden_states is None
        self.held_hidden: tuple[int, ...] = () if hidden_states is None else self._resolve_hidden(hidden_states)
        self.frozen = False

    def _resolve_hidden(self, value: Any) -> tuple[int, ...]:
        full = self.num_layers + 1
        if value == "all":
            return self._captured(range(full))
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise ConfigTypeError(
                f"hidden_states: expected None, 'all' or a list of hidden-state indices, got {describe(value)}."
            )
        out = set()
        for i in value:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not -full <= i < full:
                raise ConfigError(
                    f"hidden_states: expected indices in [-{full}, {full - 1}] (the tower returns {full} hidden "
                    f"states: embeddings and {self.num_layers} layers), got {describe(i)}."
                )
            out.add(int(i) % full)
        return self._captured(out)

    def _captured(self, indices: Iterable[int]) -> tuple[int, ...]:
        """``indices`` less the one served by ``last_hidden_state`` (:attr:`tied_last`), sorted."""
        return tuple(sorted(set(indices) - ({self.num_layers} if self.tied_last else set())))

    def _hidden_names(self) -> tuple[str, ...]:
        return tuple(f"{HIDDEN}{i}" for i in self.held_hidden)

    def _hidden_changed(self) -> None:
        """The captured entries grew (a learned call): subclasses update what derives from them."""

    def _take_hidden(self, layout: tuple[int | None, ...] | None) -> bool:
        """Whether the graphs can answer ``layout``; learns it while the outputs may still grow."""
        if layout is None:
            return True
        missing = set(self._captured(i for i in layout if i is not None)) - set(self.held_hidden)
        if not missing or (not self.learn_hidden and layout == tuple(range(self.num_layers + 1))):
            return True  # an explicit choice answers "all" with None in the slots it left out
        if self.learn_hidden and not self.frozen:
            self.held_hidden = tuple(sorted(set(self.held_hidden) | missing))
            self._hidden_changed()
            return True
        return False

    def _hidden_for_layout(self, want: Any) -> tuple[int | None, ...] | None | StockCall:
        """A call's ``output_hidden_states`` value ``want`` as the layout the graphs answer (see
        :func:`hidden_states_layout`; learned while the choice may still grow), or the :class:`StockCall` that hands
        the call to the tower's own forward: a value the graphs cannot map, or hidden states not captured."""
        try:
            layout = hidden_states_layout(want, self.num_layers)
        except InputTypeError:  # a value the graphs cannot map: the tower reads it as it does
            return StockCall("output_hidden_states of another form")
        if not self._take_hidden(layout):
            return StockCall("output_hidden_states not captured")
        return layout

    def _hidden_tuple(self, cat: Mapping[str, torch.Tensor], layout: tuple[int | None, ...] | None,
                      ) -> tuple[torch.Tensor | None, ...] | None:
        """The call's ``hidden_states`` from its outputs ``cat`` (``None`` in slots not asked for or not held)."""
        if layout is None:
            return None
        last = cat.get("last_hidden_state") if self.tied_last else None
        return tuple(last if i == self.num_layers and last is not None else None if i is None
                     else cat.get(f"{HIDDEN}{i}") for i in layout)
