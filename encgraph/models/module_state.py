"""What the graphs of a wrapped module were built for, and whether the module is still that, checked at each call.

Graphs read a module's parameters and buffers by address and bake its structure in: they stay right while values
are copied in place (``load_state_dict``, ``copy_``: the graphs read the new values) and go stale when tensors or
submodules are replaced (``.to(dtype)``, ``.half()``, ``.cuda()``, ``load_state_dict(assign=True)``, a LoRA layer
injected by PEFT, ``module.weight = nn.Parameter(...)``). :class:`ModuleState` tells those apart at a cost that
does not grow with the module:

- **Registrations.** torch calls its global registration hooks whenever any module gets a parameter, buffer or
  submodule (``__setattr__``, ``register_*``, ``add_module``). :func:`watch_registrations` installs one hook of
  each kind, once per process (on the first ``graphed()``, never at import), that bumps a counter; a state whose
  counter is behind re-reads the module's full description (every name, tensor identity, address, dtype and
  device: O(parameters), tens of microseconds for a large tower) and only then decides.
- **Moves and casts.** ``Module._apply`` (``.to``, ``.half``, ``.cuda``, ...) rebinds ``param.data`` without a
  registration; every call compares the address, dtype and device of the module's first and last parameter and
  first buffer (a sentinel): moving or casting the module, or any module above it, changes them all.

Limit: casting or moving only a *part* of a wrapped module (``tower.blocks[3].half()``), or rebinding one
``param.data`` by hand, touches no sentinel; call ``encgraph.graphs(module).reset()`` after such a change.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from encgraph.capture.grad import persistent

__all__ = ["ModuleState", "watch_registrations", "registration_epoch", "buffers_restored"]

_EPOCH = [0]
_WATCH_LOCK = threading.Lock()
_WATCHING: list[Any] = []


def _bump(*_: Any) -> None:
    _EPOCH[0] += 1  # a hook returns None: the registration goes on unchanged


def watch_registrations() -> None:
    """Install torch's three global registration hooks that count registrations (once per process)."""
    if _WATCHING:
        return
    with _WATCH_LOCK:
        if _WATCHING:
            return
        from torch.nn.modules import module as torch_module

        _WATCHING.extend([
            torch_module.register_module_parameter_registration_hook(_bump),
            torch_module.register_module_buffer_registration_hook(_bump),
            torch_module.register_module_module_registration_hook(_bump),
        ])


def registration_epoch() -> int:
    """How many parameters, buffers and submodules any module registered since :func:`watch_registrations`."""
    return _EPOCH[0]


def _tensor_facts(t: torch.Tensor | None) -> tuple[Any, ...]:
    if t is None:
        return (None,)
    return (t.data_ptr(), t.dtype, t.device)


def _sentinel_tensors(module: torch.nn.Module) -> tuple[torch.Tensor | None, ...]:
    first = next(module.parameters(), None)
    # A parameter near the end without walking the whole tree: the first one found along the chain of last
    # children (a cast of the module reaches it as surely as the first).
    last = None
    sub: torch.nn.Module | None = module
    while sub is not None and last is None:
        last = next((p for p in reversed(sub._parameters.values()) if p is not None), None)
        sub = next((m for m in reversed(sub._modules.values()) if m is not None), None)
    return first, last, next(module.buffers(), None)


def _facts(tensors: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
    return tuple(fact for t in tensors for fact in _tensor_facts(t))


def _description(module: torch.nn.Module) -> tuple[Any, ...]:
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    subs = tuple((name, id(sub)) for name, sub in module.named_modules(remove_duplicate=False))
    return tuple((name, id(t), *_tensor_facts(t)) for name, t in tensors) + subs


@attrs.define(eq=False)
class ModuleState:
    """The module as its graphs were built: a registration counter, the sentinel tensors (the same objects are
    read at every call: a cast rebinds their storage, a replacement registers) and their facts, the full
    description."""

    epoch: int
    sentinels: tuple[torch.Tensor | None, ...]
    sentinel: tuple[Any, ...]
    description: tuple[Any, ...]

    @classmethod
    def of(cls, module: torch.nn.Module) -> ModuleState:
        tensors = _sentinel_tensors(module)
        return cls(registration_epoch(), tensors, _facts(tensors), _description(module))

    def changed(self, module: torch.nn.Module) -> str | None:
        """Why graphs built for this state no longer fit ``module`` (a short reason), or ``None``. About a
        microsecond unless some module registered something since (then one full re-read; an unrelated
        registration is absorbed)."""
        if _facts(self.sentinels) != self.sentinel:
            return "module moved or cast (.to, .half, .cuda)"
        epoch = registration_epoch()
        if epoch == self.epoch:
            return None
        description = _description(module)
        if description != self.description:
            return "parameters, buffers or submodules replaced"
        self.epoch = epoch
        self.sentinels = _sentinel_tensors(module)
        return None


@contextlib.contextmanager
def buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    """Every buffer of ``module`` (BatchNorm statistics, counters, caches) holds after the block what it held
    before: a capture's warm-ups, its recorded runs and its self-check run the module on scratch inputs, which
    must leave no trace in its state."""
    with persistent():
        saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        for buffer, value in saved:
            if buffer.shape != value.shape or buffer.dtype != value.dtype:
                continue
            # A buffer made under inference_mode (a tower built there) can only be written there.
            with torch.inference_mode() if buffer.is_inference() else persistent():
                buffer.copy_(value)
