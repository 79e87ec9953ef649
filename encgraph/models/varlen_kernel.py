"""The varlen attention kernel that :mod:`encgraph.models.attention` calls: torch's Flash ``varlen_attn`` (found
once per process, with whether it takes a ``scale``), or FlashAttention-4 for a head geometry that capture measured
faster on it (:mod:`encgraph.models.fa4`).

Layout as :mod:`encgraph.models.attention`'s: ``(tokens, heads, head_dim)`` packed, ``cu_seqlens`` int32 bounding
the sequences, ``max_seqlen`` a host int.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch

from encgraph.models import fa4

__all__ = ["torch_varlen", "call_kernel"]

_VARLEN: tuple[Callable[..., torch.Tensor] | None, bool] | None = None


def torch_varlen() -> tuple[Callable[..., torch.Tensor] | None, bool]:
    """``(varlen_attn, takes_scale)``; ``(None, False)`` where this torch build lacks it (older than 2.10).

    Memoised in a module global rather than ``functools.cache``: under ``torch.compile`` dynamo reads the global
    as a constant, whereas it warns about, and traces through, an lru_cache wrapper (the import and the
    signature inspection) at every compile.
    """
    global _VARLEN
    if _VARLEN is None:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            _VARLEN = (None, False)
        else:
            try:
                takes_scale = "scale" in inspect.signature(varlen_attn).parameters
            except (TypeError, ValueError):
                takes_scale = False
            _VARLEN = (varlen_attn, takes_scale)
    return _VARLEN


def call_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor,
                cu_k: torch.Tensor, max_q: int, max_k: int, scale: float | None, kernel: str | None = None,
                ) -> torch.Tensor:
    """One call of the varlen kernel ``kernel`` (``"flash"`` or ``"fa4"``; default the geometry's,
    :func:`encgraph.models.fa4.kernel_of`), eager or inside a capture: the one place that dispatches FA4 and
    passes the scale to torch's kernel (folded into the query on torch 2.10, whose ``varlen_attn`` has none)."""
    if (kernel or fa4.kernel_of(query)) == "fa4":
        return fa4.varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, scale)
    varlen_attn, takes_scale = torch_varlen()
    default = query.shape[-1] ** -0.5
    if scale is not None and math.isclose(scale, default, rel_tol=1e-6):
        scale = None  # the kernel's own default: no folded multiply on torch 2.10
    if scale is not None and not takes_scale:
        query = query * (scale / default)
        scale = None
    return varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, **({"scale": scale} if scale is not None else {}))
