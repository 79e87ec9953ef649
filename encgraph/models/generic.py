"""A generic adapter for any ``nn.Module`` whose forward takes batch-first tensors and returns a batch-first
tensor (or a tuple, list or dict of them): the budget unit is items, the ladder is one of batch sizes, padding
rows are zeros.

The adapter learns the trailing shapes and dtypes of the inputs, and the structure and type of the output, from
the first call (or from ``example``); later calls must match them (a different trailing shape would need other
graphs: wrap that module once per shape). The output comes back as the module's own type: a tensor, a tuple or
list (a named tuple stays one), a dict or a mapping class such as transformers' ``ModelOutput``.

The adapter cannot know whether a module really is batch-first (rows never mix across the batch); the runner's
self-check at capture finds out (``verify=True``): it compares each budget's padded forward with the eager one
on sample items drawn from the first call, and drops budgets that disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from encgraph._validate import check_int, describe
from encgraph.capture.grad import persistent
from encgraph.capture.protocol import AdapterConfig, BudgetUnit, BufferSpec, FillRule, PathSpec
from encgraph.errors import ConfigError, InputError, InputTypeError
from encgraph.packing import ItemSpec

__all__ = ["GenericModuleAdapter", "concat_parts", "take_rows"]

PATH = "default"


def concat_parts(parts: Sequence[Any], kind: type | tuple[type, ...]) -> list[Any]:
    """The ``parts`` of an adapter's ``concat`` as a list, checked to be non-empty and of ``kind``."""
    if not isinstance(parts, (list, tuple)) or not parts:
        raise InputError(f"concat: expected a non-empty list of inputs, got {describe(parts)}.")
    parts = list(parts)
    for i, part in enumerate(parts):
        if not isinstance(part, kind):
            raise InputTypeError(f"concat: parts[{i}]: expected {describe_kind(kind)}, got {describe(part)}.")
    return parts


def take_rows(t: torch.Tensor, rows: Sequence[int] | np.ndarray) -> torch.Tensor:
    """Rows ``rows`` of ``t`` (dim 0), in that order, without making the host wait for the device: a view of ``t``
    when they are one ascending run (a sub-batch of consecutive items, the usual case), else ``index_select`` with
    the index built on the host and copied to ``t``'s device from pinned memory without blocking (a copy from
    pageable memory, ``torch.as_tensor(rows, device=...)``, waits for the stream's queued work: the previous
    replay). Lifetime: a view shares ``t``'s storage; the host allocator keeps the pinned index until its copy is
    done."""
    index = np.asarray(rows, dtype=np.int64).reshape(-1)
    n = index.size
    start = int(index[0]) if n else 0
    if n == 0 or (start >= 0 and np.array_equal(index, np.arange(start, start + n))):
        return t[start : start + n]
    host = torch.from_numpy(index)
    if t.device.type == "cuda":
        return t.index_select(0, host.pin_memory().to(t.device, non_blocking=True))
    return t.index_select(0, host.to(t.device))


def describe_kind(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


@attrs.frozen
class _Signature:
    """Trailing shapes and dtypes of the positional inputs; the output's structure ("tensor", "tuple",
    "list" or "dict") and names."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    kind: str
    names: tuple[str, ...]
    cls: type | None = None


class GenericModuleAdapter:
    """Adapter for a batch-first module. Inputs: a tuple of tensors with the same size in dim 0.

    Args:
        module: the module; its parameters' device and dtype are the tower's.
        max_batch: the largest batch size captured (default 32); the default ladder is 1, 2, 4, ... up to it.
        example: optional example positional inputs (a tensor or a tuple), to capture before the first call.
    """

    def __init__(self, module: torch.nn.Module, *, max_batch: int = 32, example: Any = None) -> None:
        if not isinstance(module, torch.nn.Module):
            raise InputTypeError(f"module: expected a torch.nn.Module, got {describe(module)}.")
        self._module = module
        self.max_batch = check_int("max_batch", max_batch, minimum=1)
        param = next(iter(module.parameters()), None)
        self._device = param.device if param is not None else torch.device("cpu")
        self._dtype = param.dtype if param is not None else torch.float32
        self._signature: _Signature | None = None
        self._example: tuple[torch.Tensor, ...] | None = None  # one item of the first call, for sample_inputs
        self._not_batch_first: str | None = None
        if example is not None:
            self.item_specs(self.inputs_from_call(*(example if isinstance(example, tuple) else (example,))))

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    @property
    def config(self) -> AdapterConfig:
        names = self._signature.names if self._signature is not None else ("out",)
        return AdapterConfig(
            paths=PathSpec(PATH, 1, self.max_batch, outputs=names, unit=BudgetUnit.ITEMS),
            dtype=self._dtype,
            device=self._device,
        )

    # -- inputs
    @property
    def stock_reason(self) -> str | None:
        """Why every call is answered by the module's own forward (the self-check found rows mixing), or None."""
        return self._not_batch_first

    def selfcheck_failed(self, path: str, budget: int, reason: str) -> bool:
        """The runner's self-check found the padded forward off the eager one: this module mixes rows across
        the batch, so no split or padded batch can stand in for it; every budget goes (returns True) and
        ``encgraph.graphed`` answers every call with the module's own forward."""
        self._not_batch_first = "module mixes rows across the batch (self-check)"
        return True

    def inputs_from_call(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        if kwargs:
            raise InputTypeError(
                f"graphed module: keyword arguments are not supported by the generic adapter, got "
                f"{sorted(kwargs)}; pass tensors positionally."
            )
        return tuple(args)

    def item_specs(self, inputs: tuple[torch.Tensor, ...]) -> list[ItemSpec]:
        if not isinstance(inputs, tuple) or not inputs:
            raise InputTypeError(f"inputs: expected a non-empty tuple of tensors, got {describe(inputs)}.")
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise InputTypeError(f"inputs[{i}]: expected a batch-first tensor, got {describe(t)}.")
            if t.device != self._device:
                raise InputError(
                    f"inputs[{i}]: expected a tensor on {self._device} (where the module is), got {t.device}; "
                    f"move it with .to({str(self._device)!r})."
                )
        batch = inputs[0].shape[0]
        if any(t.shape[0] != batch for t in inputs):
            raise InputError(
                f"inputs: every tensor must have the same batch size in dim 0, got {[t.shape[0] for t in inputs]}."
            )
        shapes = tuple(tuple(t.shape[1:]) for t in inputs)
        dtypes = tuple(t.dtype for t in inputs)
        if self._signature is None:
            if batch == 0:
                raise InputError("inputs: expected at least one item, got an empty batch.")
            self._signature = self._probe(inputs, shapes, dtypes)
            with persistent():
                self._example = tuple(t[:1].detach().clone() for t in inputs)
        elif (shapes, dtypes) != (self._signature.shapes, self._signature.dtypes):
            raise InputError(
                f"inputs: the graphs were built for trailing shapes {list(self._signature.shapes)} and dtypes "
                f"{list(self._signature.dtypes)}, got {list(shapes)} and {list(dtypes)}; wrap the module once per "
                "input shape."
            )
        return [ItemSpec(1)] * batch

    def _probe(self, inputs: tuple[torch.Tensor, ...], shapes: Any, dtypes: Any) -> _Signature:
        with torch.inference_mode():
            out = self._module(*(t[:1] for t in inputs))
        if isinstance(out, torch.Tensor):
            return _Signature(shapes, dtypes, "tensor", ("out",))
        if isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
            kind = "tuple" if isinstance(out, tuple) else "list"
            return _Signature(shapes, dtypes, kind, tuple(str(i) for i in range(len(out))), type(out))
        if isinstance(out, Mapping) and out and all(isinstance(o, torch.Tensor) for o in out.values()):
            return _Signature(shapes, dtypes, "dict", tuple(str(k) for k in out), type(out))
        raise InputTypeError(
            f"module output: the generic adapter needs a batch-first tensor, or a tuple, list or dict of them, got "
            f"{describe(out)}."
        )

    def sample_inputs(self, path: str, tokens: int) -> tuple[torch.Tensor, ...]:
        """``tokens`` items like the first call's first item: floating inputs with noise of its scale added
        (so the items differ), other dtypes repeated as they were."""
        n = check_int("tokens", tokens, minimum=1)
        if self._example is None:
            raise ConfigError("generic adapter: no sample before the first call; call the module once first.")
        out = []
        for t in self._example:
            rows = t.expand(n, *t.shape[1:]).clone()
            if rows.is_floating_point():
                scale = float(t.float().std()) if t.numel() > 1 else 1.0
                rows = rows + torch.randn_like(rows) * (scale if scale > 0 else 1.0)
            out.append(rows)
        return tuple(out)

    def select(self, inputs: tuple[torch.Tensor, ...], indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
        return tuple(take_rows(t, indices) for t in inputs)

    def concat(self, parts: Sequence[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """One input tuple holding every part's items in order (each positional tensor concatenated in dim 0);
        every part was validated by ``item_specs`` (same trailing shapes and dtypes)."""
        parts = concat_parts(parts, tuple)
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(column) for column in zip(*parts))

    # -- static buffers and forwards
    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> dict[str, BufferSpec]:
        sig = self._require_signature()
        return {
            f"arg{i}": BufferSpec((budget, *shape), dtype, FillRule.ZERO)
            for i, (shape, dtype) in enumerate(zip(sig.shapes, sig.dtypes))
        }

    def replay_values(self, path: str, inputs: tuple[torch.Tensor, ...], budget: int) -> dict[str, torch.Tensor]:
        return {f"arg{i}": t for i, t in enumerate(inputs)}

    def forward_static(self, path: str, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
        args = [buffers[f"arg{i}"] for i in range(len(buffers))]
        return self._named(self._module(*args))

    def forward_eager(self, path: str, inputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        return self._named(self._module(*inputs))

    def _named(self, out: Any) -> dict[str, torch.Tensor]:
        sig = self._require_signature()
        if sig.kind == "tensor":
            return {"out": out}
        if sig.kind == "dict":
            return {k: out[k] for k in sig.names}
        return {name: out[i] for i, name in enumerate(sig.names)}

    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return dict(parts[PATH])

    def output_for_call(self, results: list[dict[str, torch.Tensor]], inputs: Any) -> Any:
        sig = self._require_signature()
        cat = {name: torch.cat([r[name] for r in results]) for name in sig.names}
        if sig.kind == "tensor":
            return cat["out"]
        if sig.kind == "dict":
            return _rebuild_mapping(sig.cls, cat)
        seq = [cat[name] for name in sig.names]
        if sig.kind == "tuple":
            return _rebuild_tuple(sig.cls, seq)
        return seq if sig.cls in (None, list) else _try(lambda: sig.cls(seq), seq)

    def unwrap(self) -> torch.nn.Module:
        return self._module

    def _require_signature(self) -> _Signature:
        if self._signature is None:
            raise ConfigError(
                "generic adapter: input shapes are unknown before the first call; call the module once, or pass "
                "example=(tensors...) to capture ahead."
            )
        return self._signature


def _try(build: Any, fallback: Any) -> Any:
    try:
        return build()
    except Exception:  # a container class that cannot be rebuilt from its items: its plain equivalent
        return fallback


def _rebuild_mapping(cls: type | None, values: dict[str, torch.Tensor]) -> Any:
    """``values`` as the module's own mapping type (a transformers ``ModelOutput`` takes its fields as keywords)."""
    if cls in (None, dict):
        return dict(values)
    return _try(lambda: cls(**values), None) or _try(lambda: cls(values), dict(values))


def _rebuild_tuple(cls: type | None, items: list[torch.Tensor]) -> Any:
    if cls in (None, tuple):
        return tuple(items)
    if hasattr(cls, "_fields"):  # a named tuple
        return _try(lambda: cls(*items), tuple(items))
    return _try(lambda: cls(items), tuple(items))
