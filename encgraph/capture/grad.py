"""Grad modes: what the runner's long-lived tensors are created under, and when a call really asks for autograd.

A drop-in must work in every grad mode and in any order (design rule 12): Hugging Face ``generate()`` runs under
``torch.no_grad()``, servers under ``torch.inference_mode()``, notebooks under neither. A tensor created inside
``inference_mode`` is an *inference tensor*: outside that mode it can never be written in place again, so a
static buffer first allocated during a call under ``inference_mode`` would break every later ``no_grad`` call.
Everything the runner and adapters keep across calls (static buffers, output buffers, captured graphs, rewritten
weights, device-side caches) is therefore created under :func:`persistent`; writing into such ordinary tensors
inside ``inference_mode`` is allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs
import torch

__all__ = ["persistent", "autograd_requested", "tensors_in"]


@contextlib.contextmanager
def persistent() -> Iterator[None]:
    """Tensors created inside are ordinary tensors (never inference tensors) without autograd history."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def tensors_in(value: Any, _seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """The tensors reachable from ``value`` through mappings, lists and tuples, and attrs and dataclass instances'
    fields, each once: a call's inputs (:func:`autograd_requested`), a request's prepared inputs
    (:meth:`encgraph.serving.transfer.SideWork.keep_all`)."""
    seen = set() if _seen is None else _seen
    if id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None))):
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from tensors_in(v, seen)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v, seen)
    elif attrs.has(type(value)):
        for field in attrs.fields(type(value)):
            yield from tensors_in(getattr(value, field.name), seen)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name), seen)


def autograd_requested(module: torch.nn.Module, args: Iterable[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a call of ``module`` with these arguments would record autograd: grad mode is on (not
    ``no_grad``, not ``inference_mode``) and an input tensor or a parameter requires grad.

    Cheap when grad is off (the common serving case); otherwise one pass over the parameters (tens of us).
    """
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return False
    if any(t.requires_grad for t in tensors_in((args, kwargs))):
        return True
    return any(p.requires_grad for p in module.parameters())
