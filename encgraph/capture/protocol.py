"""What the runner asks of a model: the adapter protocol and the specs it is described by.

The runner knows nothing model-specific. An adapter describes its tower (paths, budgets, named outputs), turns
a caller's inputs into :class:`~encgraph.packing.ItemSpec` s, declares the static buffers a captured forward
reads (with a :class:`FillRule` per buffer, so that the runner writes every row of every buffer on every
replay), computes the values of those buffers for a sub-batch on the host, and runs the static-shape forward
(captured) and the eager forward (fallback).

Buffer lifetimes: the runner allocates each buffer once per path at the largest budget; a budget's graph reads
views of its leading rows. Values given by ``replay_values`` are copied in before each replay and may be freed
right after the call returns.

Output layout, for both forwards: a dict of named tensors whose dim 0 counts the path's budget unit (output
tokens for a token path, items for a batch ladder); the items of the sub-batch occupy consecutive rows in item
order (item ``j`` has ``spec.tokens[path]`` rows), and for the static forward rows past the real tokens are
padding, which the runner never hands out.

Optional adapter methods (:data:`OPTIONAL_METHODS`; the runner and the serving front use them where present and
say so in ``stats`` / a log line where absent):

- ``sample_inputs(path, tokens) -> inputs``: synthetic inputs, as a call would pass them (random values, never
  zeros, on the tower's device and dtype), whose items put about ``tokens`` (the path's budget unit) on ``path``
  and as little as the adapter allows on other paths; one item where one item can hold ``tokens``. ``capture()``
  times the eager forward on them for the default cost model, and the self-check compares forwards on them.
- ``concat(parts) -> inputs``: one inputs object holding the items of every part in order (part 0's first);
  every part was already validated by ``item_specs``. The serving front coalesces requests with it.
- ``check_before_capture(tolerance)``: eager checks of the adapter's own on scratch inputs, which the runner runs
  (with ``verify``) before it captures its first graph, beside the self-check's eager forwards, so that no eager
  forward's activations sit beside the graphs' pool (the generic adapter's split check; its verdict is read after
  the capture).

An optional attribute, ``assemble_copies`` (default ``False``): ``True`` says that ``assemble`` returns results
with storage of their own, never views of the rows it is given. The runner then hands it a replay's rows as views
of the graph's output buffer (``assemble`` runs before the next replay) instead of copying them first, so that
each item is copied once, not twice.

A :class:`ModuleAdapter`'s ``inputs_from_call`` may return :class:`StockCall` for a valid call that the graphs
cannot answer exactly as the module would (per-layer hidden states or attentions asked for, autograd asked for):
:func:`encgraph.graphed` then runs the module's own forward (inside the adapter's optional ``stock_context()``,
which puts back what wrapping changed, e.g. the attention implementation) and counts the reason in
``stats["eager_reasons"]``.

``encgraph.models.protocol`` re-exports these names for adapter authors; they live here so that the runner
(``capture``) does not import the adapter layer (``models``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from encgraph._validate import check_int, check_str, describe
from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing import ItemSpec

__all__ = [
    "BudgetUnit", "FillRule", "BufferSpec", "PathSpec", "AdapterConfig", "EncoderAdapter", "ModuleAdapter", "StockCall",
    "OPTIONAL_METHODS",
]


class BudgetUnit(enum.Enum):
    """What a path's budgets count."""

    TOKENS = "tokens"
    """Output tokens (variable-size items: Qwen-VL patches after the merger). Items per batch are capped by the
    smallest budget (vLLM PR 38040)."""
    ITEMS = "items"
    """Items (fixed-resolution towers: a ladder of batch sizes). Every item counts 1."""


class FillRule(enum.Enum):
    """How the runner fills the rows of a buffer past the values an adapter gives for a sub-batch.

    Every row is written on every replay, so no stale value (NaN left in a shared pool by another graph,
    design rule 1) can reach a valid token.
    """

    ZERO = "zero"
    """Rows past the values are zero (pixel rows, position ids, interpolation weights)."""
    REPEAT_LAST = "repeat_last"
    """Rows past the values repeat the last value row (cumulative buffers: zeros would give negative lengths,
    rule 2). With no values, zero."""
    ARANGE = "arange"
    """Rows past the values continue ``0..N-1`` (a permutation buffer maps padding rows to themselves)."""
    SEQUENCE_BOUNDS = "sequence_bounds"
    """A 1-D cumulative ``cu_seqlens`` buffer: the values (a host tensor: ``0`` then the running end of each real
    sequence) are followed by trailing padding sequences of at most ``chunk`` rows that end at ``total`` (the
    padded row count, so ``cu_seqlens[-1]`` covers every row: rule 1; chunks respect the per-layer
    ``max_seqlen``: rule 3), then by ``total`` repeated (zero-length sequences) to the buffer's end."""


def _check_shape(instance: Any, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    if not isinstance(value, tuple) or not value or not all(isinstance(d, int) and d >= 0 for d in value):
        raise ConfigError(f"BufferSpec.shape: expected a non-empty tuple of ints >= 0, got {describe(value)}.")


@attrs.frozen
class BufferSpec:
    """One static input buffer of a captured forward, at one budget.

    ``shape[0]`` may grow with the budget; the other dims must be the same for every budget of a path (the
    runner allocates the largest and hands each budget a view of its leading rows).
    """

    shape: tuple[int, ...] = attrs.field(converter=tuple, validator=_check_shape)
    dtype: torch.dtype = attrs.field(validator=attrs.validators.instance_of(torch.dtype))
    fill: FillRule = attrs.field(default=FillRule.ZERO, validator=attrs.validators.instance_of(FillRule))
    total: int | None = None
    chunk: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.fill is FillRule.SEQUENCE_BOUNDS:
            if len(self.shape) != 1:
                raise ConfigError(f"BufferSpec: a SEQUENCE_BOUNDS buffer must be 1-D, got shape {self.shape}.")
            check_int("BufferSpec.total", self.total, minimum=0, hint="Give the padded row count it covers.")
            check_int("BufferSpec.chunk", self.chunk, minimum=1, hint="Give the longest padding sequence.")
            needed = 1 + -(-self.total // self.chunk)
            if self.shape[0] < needed:
                raise ConfigError(
                    f"BufferSpec.shape: a SEQUENCE_BOUNDS buffer covering {self.total} rows in chunks of "
                    f"{self.chunk} needs at least {needed} slots even with no real sequence, got {self.shape[0]}."
                )


@attrs.frozen
class PathSpec:
    """One independently captured sub-network of an encoder (most towers have one, ``"default"``).

    ``min_budget``/``max_budget`` bound the default ladder (in the path's budget unit); ``allow_empty`` lets a
    batch have no tokens on this path (budget 0: skipped); ``outputs`` names the tensors the path returns.
    """

    name: str = attrs.field(validator=lambda i, a, v: check_str("PathSpec.name", v))
    min_budget: int = attrs.field(validator=lambda i, a, v: check_int("PathSpec.min_budget", v, minimum=1))
    max_budget: int = attrs.field(validator=lambda i, a, v: check_int("PathSpec.max_budget", v, minimum=1))
    allow_empty: bool = False
    outputs: tuple[str, ...] = attrs.field(default=("out",), converter=tuple)
    unit: BudgetUnit = attrs.field(default=BudgetUnit.TOKENS, validator=attrs.validators.instance_of(BudgetUnit))

    def __attrs_post_init__(self) -> None:
        if self.max_budget < self.min_budget:
            raise ConfigError(
                f"PathSpec {self.name!r}: max_budget ({self.max_budget}) is below min_budget ({self.min_budget})."
            )
        if not self.outputs or not all(isinstance(o, str) and o for o in self.outputs):
            raise ConfigError(f"PathSpec {self.name!r}: outputs must be non-empty names, got {self.outputs!r}.")


def _to_paths(value: Sequence[PathSpec] | PathSpec) -> tuple[PathSpec, ...]:
    return (value,) if isinstance(value, PathSpec) else tuple(value)


@attrs.frozen
class AdapterConfig:
    """The static description of an adapter's tower.

    ``dtype`` is the compute dtype of the tower; ``device`` where its weights live.
    """

    paths: tuple[PathSpec, ...] = attrs.field(converter=_to_paths)
    max_frames_per_item: int = 1
    dtype: torch.dtype = torch.float32
    device: torch.device = attrs.field(default=torch.device("cpu"), converter=torch.device)

    def __attrs_post_init__(self) -> None:
        if not self.paths or not all(isinstance(p, PathSpec) for p in self.paths):
            raise ConfigTypeError(f"AdapterConfig.paths: expected PathSpec objects, got {describe(self.paths)}.")
        names = [p.name for p in self.paths]
        if len(set(names)) != len(names):
            raise ConfigError(f"AdapterConfig.paths: path names must be unique, got {names}.")
        check_int("AdapterConfig.max_frames_per_item", self.max_frames_per_item, minimum=1)

    @property
    def path_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.paths)

    def path(self, name: str) -> PathSpec:
        for p in self.paths:
            if p.name == name:
                return p
        raise ConfigError(f"path: expected one of {list(self.path_names)}, got {name!r}.")


@attrs.frozen
class StockCall:
    """What ``inputs_from_call`` returns for a call to answer with the module's own forward, and why
    (``reason``: a short phrase counted in ``stats["eager_reasons"]``, e.g. "output_hidden_states requested")."""

    reason: str = attrs.field(validator=lambda i, a, v: check_str("StockCall.reason", v))


OPTIONAL_METHODS = ("sample_inputs", "concat", "check_before_capture")
"""Adapter methods the runner and serving use where an adapter has them (see the module docs)."""


@runtime_checkable
class EncoderAdapter(Protocol):
    """The model-specific half of encgraph. ``Inputs`` is whatever the adapter's callers pass (a tensor, a
    tuple of pixel rows and grids, ...); the runner only hands it back to the adapter."""

    @property
    def config(self) -> AdapterConfig: ...

    def item_specs(self, inputs: Any) -> list[ItemSpec]:
        """One spec per item of ``inputs``, in order; validates the inputs (raise ``InputError`` /
        ``InputTypeError`` on contradictions). Must not sync the device."""
        ...

    def select(self, inputs: Any, indices: Sequence[int]) -> Any:
        """The sub-batch holding items ``indices`` (in that order)."""
        ...

    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> Mapping[str, BufferSpec]:
        """The static buffers the forward of ``path`` at ``budget`` reads, sized for at most ``max_items``
        items and ``max_frames`` attention sequences."""
        ...

    def replay_values(self, path: str, inputs: Any, budget: int) -> Mapping[str, torch.Tensor]:
        """For each buffer, the values of its leading rows for this sub-batch (SEQUENCE_BOUNDS values on the
        host); the runner fills the remaining rows by the buffer's rule."""
        ...

    def forward_static(self, path: str, buffers: Mapping[str, torch.Tensor], budget: int) -> Mapping[str, torch.Tensor]:
        """The static-shape forward: reads only ``buffers`` (views sized for ``budget``), takes host constants
        (``max_seqlen``) from ``budget`` alone, never syncs the host. Returns the named outputs with
        ``budget`` rows in dim 0."""
        ...

    def forward_eager(self, path: str, inputs: Any) -> Mapping[str, torch.Tensor]:
        """The eager forward of a sub-batch: named outputs, the items' rows concatenated in order."""
        ...

    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> Any:
        """One item's result from its per-path named outputs (only the paths where it has tokens)."""
        ...


@runtime_checkable
class ModuleAdapter(EncoderAdapter, Protocol):
    """An adapter that can stand in for an ``nn.Module`` (what :func:`encgraph.graphed` needs)."""

    @property
    def module(self) -> torch.nn.Module: ...

    def inputs_from_call(self, *args: Any, **kwargs: Any) -> Any:
        """The adapter's inputs from the module's own forward arguments."""
        ...

    def output_for_call(self, results: list[Any], inputs: Any) -> Any:
        """The module's own output type from the per-item results (in input order)."""
        ...

    def unwrap(self) -> torch.nn.Module:
        """Undo what wrapping changed on the module (attention setting) and return it."""
        ...
