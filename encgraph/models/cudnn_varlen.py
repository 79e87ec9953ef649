"""cuDNN's packed SDPA (``(tokens, heads, head_dim)``, ragged offsets from ``cu_seqlens``) through NVIDIA's
``nvidia-cudnn-frontend`` wheel (``cudnn.sdpa_torch``, frontend 1.32 or later) as the varlen kernel of a head
geometry inside captured graphs, where capture measured it the fastest (:mod:`encgraph.models.kernel_choice`).

Why: replayed from graphs on an H100 (torch 2.11, ``benches/results/attention_kernels_nvidia-h100-80gb-hbm3.md``)
it ran at 1.4-1.6x torch's Flash varlen on the towers' geometries (16 heads x 72: 335 against 209 TF/s on one
896 px image, 177 against 118 on 16 x 256), dense cuDNN's rate on one long sequence, and equal to its eager call
after the lengths were rewritten. torch 2.11's own ragged cuDNN op (``aten._cudnn_attention_forward`` with
``cum_seq_q``) builds its plan at every call, inside a capture too, so it cannot be captured (docs/design.md).

The frontend builds one cuDNN graph per shape (sequence slots, longest sequence, strides, scale) at its first call
(a plan: tens of ms) and keeps it; later calls only execute it on torch's current stream, which a capture records.
So it runs in graphs only (:func:`encgraph.capture.recording.graph_calls`: a budget's warm-ups build its
plans, its capture records their execution); eager forwards keep Flash or FlashAttention-4, and so does a call
whose keys have other bounds than its queries (:func:`encgraph.models.attention.attend_per_sequence`: one query
per sequence, some of which may be empty). ``max_seqlen`` is rounded up as for FlashAttention-4
(:func:`encgraph.models.fa4.bound`), so that a few plans serve every length.

A plan a captured graph replays must outlive the graph, and the frontend keeps at most 128, dropping the oldest:
every plan in its cache when a graph's call is made (a warm-up's or a capture's) is kept here too
(:data:`_PINNED`), for the process. A capture whose plan the frontend dropped after its warm-up (more than 128
shapes between the two; one tower's ladder makes about 40) would build it inside the capture, which fails that
budget: it then runs eagerly, counted as a failed capture (``capture_info["failed"]``).
Importing this module imports neither the wheel nor cuDNN; :func:`available` does, once per device.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch

from encgraph.capture.recording import in_graph_calls
from encgraph.models.fa4 import bound

__all__ = ["available", "fits", "pinned", "varlen_attn"]

log = logging.getLogger("encgraph")

_AVAILABLE: dict[int, bool] = {}  # per device index
_PINNED: dict[Any, Any] = {}
"""The frontend's cached graphs (plans) when any graph's call of this process was made: kept alive here."""
_WARNED: list[bool] = []


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def available(device: torch.device) -> bool:
    """Whether cuDNN's packed SDPA can run on the CUDA ``device``: the frontend wheel imports with its torch entry
    (``cudnn.sdpa_torch``), and the GPU is an Ampere or newer one (compute capability 8.0 and up). A wheel that is
    installed but does not import is logged, once per device."""
    if device.type != "cuda":
        return False
    index = _index(device)
    if index not in _AVAILABLE:
        ok = False
        if torch.cuda.get_device_capability(index)[0] >= 8 and importlib.util.find_spec("cudnn") is not None:
            try:
                import cudnn

                ok = callable(cudnn.sdpa_torch)  # a lazy export: importing it registers the frontend's torch ops
            except Exception as exc:  # a broken or too old wheel leaves the other kernels in place
                log.warning("encgraph: nvidia-cudnn-frontend is installed but its SDPA does not import (%s: %s); "
                            "graphs keep torch's Flash or FlashAttention-4.", type(exc).__name__, exc)
        _AVAILABLE[index] = ok
    return _AVAILABLE[index]


def fits(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this head geometry can run here: :func:`available`, fp16/bf16, a head dim that is a multiple of 8
    up to 128 (256 on Hopper and newer: cuDNN's SDPA forward's range)."""
    if dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or not available(device):
        return False
    return head_dim <= (256 if torch.cuda.get_device_capability(_index(device))[0] >= 9 else 128)


def varlen_attn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                cu_seq_k: torch.Tensor, max_q: int, max_k: int, scale: float | None = None) -> torch.Tensor:
    """cuDNN's non-causal packed SDPA in the signature of torch's ``varlen_attn``; arguments and result as
    :func:`encgraph.models.fa4.varlen_attn`'s (the head dim contiguous, ``max_q``/``max_k`` rounded up by
    :func:`~encgraph.models.fa4.bound`, rows past ``cu_seq_q[-1]`` unwritten)."""
    import cudnn

    out = cudnn.sdpa_torch(query, key, value, scale=scale, cu_seqlens_q=cu_seq_q, cu_seqlens_kv=cu_seq_k,
                           max_seqlen_q=bound(max_q), max_seqlen_kv=bound(max_k))
    if in_graph_calls() or torch.cuda.is_current_stream_capturing():
        _pin()
    return out


def _pin() -> None:
    """Keep every plan of the frontend's cache (the one just recorded among them) for the process."""
    try:
        from cudnn.sdpa.fwd import torch_op

        cache = torch_op._graph_cache  # the frontend's own plan cache (bounded, oldest dropped first)
    except (ImportError, AttributeError) as exc:
        if not _WARNED:
            _WARNED.append(True)
            log.warning("encgraph: cannot keep cuDNN's SDPA plans for the captured graphs (%s: %s; another "
                        "nvidia-cudnn-frontend release): a graph may replay a plan the frontend dropped after 128 "
                        "newer ones.", type(exc).__name__, exc)
        return
    _PINNED.update(cache)


def pinned() -> int:
    """How many of the frontend's plans are kept for captured graphs."""
    return len(_PINNED)
