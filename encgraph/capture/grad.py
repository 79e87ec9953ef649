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
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["persistent", "autograd_requested"]


@contextlib.contextmanager
def persistent() -> Iterator[None]:
    """Tensors created inside are ordinary tensors (never inference tensors) without autograd history."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def autograd_requested(module: torch.nn.Module, args: Iterable[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a call of ``module`` with these arguments would record autograd: grad mode is on (not
    ``no_grad``, not ``inference_mode``) and an input tensor or a parameter requires grad.

    Cheap when grad is off (the common serving case); otherwise one pass over the parameters (tens of us).
    """
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return False
    if any(t.requires_grad for t in _tensors(list(args)) ) or any(t.requires_grad for t in _tensors(kwargs)):
        return True
    return any(p.requires_grad for p in module.parameters())
