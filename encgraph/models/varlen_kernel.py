"""The varlen attention kernel that :mod:`encgraph.models.attention` calls, and which one each head geometry runs.

Kernels (:data:`KERNELS`): torch's Flash ``varlen_attn`` (found once per process, with whether it takes a
``scale``); FlashAttention-4 (:mod:`encgraph.models.fa4`); cuDNN's packed SDPA through NVIDIA's frontend
(:mod:`encgraph.models.cudnn_varlen`), in graphs only. Capture measures them per device and head geometry
(:mod:`encgraph.models.kernel_choice`) and registers the choice here (:func:`use`): one kernel for the calls
that captured graphs hold (the capture's and its warm-ups': :func:`encgraph.capture.recording.graph_calls`), one
for every other call (eager forwards). cuDNN builds a plan per shape (sequence slots, longest sequence) on its
first call, which a graph pays once at capture and an eager forward would pay at each new batch: it never runs
eagerly.

Layout as :mod:`encgraph.models.attention`'s: ``(tokens, heads, head_dim)`` packed, ``cu_seqlens`` int32 bounding
the sequences, ``max_seqlen`` a host int.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch

from encgraph.capture.recording import in_graph_calls
from encgraph.errors import ConfigError
from encgraph.models import cudnn_varlen, fa4

__all__ = ["EAGER_KERNELS", "KERNELS", "call_kernel", "kernel_of", "torch_varlen", "use"]

KERNELS = ("flash", "fa4", "cudnn")
"""The varlen kernels a head geometry may run: torch's ``varlen_attn`` (Flash Attention 2), FlashAttention-4 and
cuDNN's packed SDPA (graphs only)."""
EAGER_KERNELS = ("flash", "fa4")
"""The kernels an eager call may run (no plan per shape)."""

_VARLEN: tuple[Callable[..., torch.Tensor] | None, bool] | None = None
_CHOSEN: dict[tuple[int, int, torch.dtype, int], tuple[str, str]] = {}
"""``(heads, head_dim, dtype, device index) -> (graph kernel, eager kernel)`` where either is not ``"flash"``."""


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


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def use(heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, kernel: str,
        eager: str | None = None) -> None:
    """Run encgraph's varlen calls of this head geometry and dtype on the CUDA ``device`` with ``kernel`` in
    captured graphs and ``eager`` elsewhere (default ``kernel``, or ``"flash"`` where ``kernel`` is ``"cudnn"``);
    each must be available there. For the process, from the next call; a graph captured before keeps the kernel
    it captured."""
    eager = eager if eager is not None else (kernel if kernel in EAGER_KERNELS else "flash")
    if kernel not in KERNELS:
        raise ConfigError(f"varlen_kernel.use(kernel): expected one of {KERNELS}, got {kernel!r}.")
    if eager not in EAGER_KERNELS:
        raise ConfigError(f"varlen_kernel.use(eager): expected one of {EAGER_KERNELS} (cuDNN builds a plan per "
                          f"shape: graphs only), got {eager!r}.")
    if device.type != "cuda":
        raise ConfigError(f"varlen_kernel.use(device): expected a CUDA device, got {device}.")
    if "fa4" in (kernel, eager) and not fa4.available(device):
        raise ConfigError(f"varlen_kernel.use: FlashAttention-4 cannot run on {device} (the flash-attn-4 wheel is "
                          "not installed, or the GPU is not a Hopper or Blackwell one); install flash-attn-4 (with "
                          "nvidia-cutlass-dsl[cu13] for a CUDA 13 torch) on such a GPU, or pass kernel='flash'.")
    if kernel == "cudnn" and not cudnn_varlen.available(device):
        raise ConfigError(f"varlen_kernel.use(kernel='cudnn'): cuDNN's packed SDPA cannot run on {device} (the "
                          "nvidia-cudnn-frontend wheel is not installed or does not import, or the GPU is older "
                          "than Ampere); pip install nvidia-cudnn-frontend, or pass kernel='flash'.")
    key = (int(heads), int(head_dim), dtype, _index(device))
    if kernel == eager == "flash":
        _CHOSEN.pop(key, None)
    else:
        _CHOSEN[key] = (kernel, eager)


def kernel_of(query: torch.Tensor, self_attention: bool = True) -> str:
    """The varlen kernel of ``query``'s ``(tokens, heads, head_dim)`` geometry, dtype and device: its graph
    kernel within :func:`~encgraph.capture.recording.graph_calls`, else its eager one (:func:`use`; ``"flash"``
    where none was chosen). A call whose keys have other bounds than its queries (``self_attention=False``) gets
    the eager kernel where the graph kernel is cuDNN's (:mod:`encgraph.models.cudnn_varlen` says why)."""
    if not _CHOSEN or not query.is_cuda:
        return "flash"
    chosen = _CHOSEN.get((int(query.shape[1]), int(query.shape[2]), query.dtype, _index(query.device)))
    if chosen is None:
        return "flash"
    graph, eager = chosen
    return graph if in_graph_calls() and (self_attention or graph != "cudnn") else eager


def call_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor,
                cu_k: torch.Tensor, max_q: int, max_k: int, scale: float | None, kernel: str | None = None,
                ) -> torch.Tensor:
    """One call of the varlen kernel ``kernel`` (one of :data:`KERNELS`; default the geometry's,
    :func:`kernel_of`), eager or inside a capture: the one place that dispatches the kernels and passes the scale
    to torch's (folded into the query on torch 2.10, whose ``varlen_attn`` has none)."""
    kernel = kernel or kernel_of(query, self_attention=cu_q.data_ptr() == cu_k.data_ptr())
    if kernel == "fa4":
        return fa4.varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, scale)
    if kernel == "cudnn":
        return cudnn_varlen.varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, scale)
    varlen_attn, takes_scale = torch_varlen()
    default = query.shape[-1] ** -0.5
    if scale is not None and math.isclose(scale, default, rel_tol=1e-6):
        scale = None  # the kernel's own default: no folded multiply on torch 2.10
    if scale is not None and not takes_scale:
        query = query * (scale / default)
        scale = None
    return varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, **({"scale": scale} if scale is not None else {}))
