"""Packed variable-length attention that is safe inside a CUDA graph, and its Hugging Face registration.

Layout: the tokens of every sequence of a batch are packed into one ``(tokens, heads, head_dim)`` tensor;
``cu_seqlens`` (a 1-D int tensor of a fixed number of slots, ``[0, e1, e2, ..., tokens, tokens, ...]``) bounds
the sequences. Trailing zero-length sequences are allowed, so a captured graph can read a buffer with more slots
than a replay has sequences; the padded layout of encgraph ends its last (padding) sequence at ``tokens``, so
every row is written (design rule 1). ``max_seqlen`` is a host int fixed per layer at capture (rule 3).

Backends (chosen per call from the tensors, never from their values, so the choice is the same at capture and
at replay):

- ``VARLEN``: ``torch.nn.attention.varlen.varlen_attn`` (Flash Attention) on CUDA with fp16/bf16, or
  FlashAttention-4 where capture measured it faster (:mod:`encgraph.models.varlen_kernel`);
- ``SEGMENTS``: on the CPU, ``scaled_dot_product_attention`` of each sequence on its own (exact, isolated and
  memory-bounded: :func:`~encgraph.models.exact_attention.segment_attention`);
- an eager forward that passes its bounds from the host (:func:`host_bounds`, :mod:`encgraph.models.sequence_bounds`)
  runs, on CUDA, each sequence of at least the measured rows (:mod:`encgraph.models.kernel_choice`: where one
  forward's saving pays cuDNN's plan of a new length; :data:`SEGMENT_MIN_ROWS` where none was measured) as one
  dense SDPA call, as the tower's own forward does (cuDNN on an H100 or H200: 350-430 TF/s at head dim 72-80,
  against Flash varlen's 210-260; ``benches/attention_kernels.py``), and each run of shorter sequences between
  them as one varlen call. Captured and compiled calls never do (:func:`~encgraph.models.sequence_bounds.lookup`);
- ``MASKED_SDPA``: on CUDA in fp32 or where varlen is missing (and on the ``meta`` device): one SDPA call under a
  block-diagonal mask built on the device (capturable; ``tokens^2`` memory and 3-21x slower than varlen on a GPU:
  a fallback, not a fast path; NaN isolated per sequence, rule 13):
  :func:`~encgraph.models.exact_attention.masked_attention`.

For Hugging Face towers the function is registered with ``transformers.AttentionInterface`` under a name that
contains "flash" (:data:`ATTENTION_NAME`): the Qwen-VL towers take their packed ``cu_seqlens`` path only for such
names, and otherwise split on ``cu_seqlens.tolist()``, which cannot be captured.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from encgraph._validate import describe
from encgraph.errors import ConfigError, InputError
from encgraph.models import sequence_bounds, varlen_kernel
from encgraph.models._hf import AttentionSwitch, require_transformers, switch_attention
from encgraph.models.exact_attention import dense_sequence, masked_attention, repeat_heads, segment_attention
from encgraph.models.sequence_bounds import RowsTable, host_bounds

__all__ = [
    "ATTENTION_NAME",
    "MIN_TRANSFORMERS",
    "SEGMENT_MIN_ROWS",
    "AttentionBackend",
    "RowsTable",
    "attend_per_sequence",
    "hf_attention_forward",
    "host_bounds",
    "packed_attention",
    "pick_backend",
    "register_attention",
    "use_packed_attention",
]

ATTENTION_NAME = "encgraph_flash_varlen"
"""The name registered with ``transformers.AttentionInterface``; contains "flash" so that towers take their packed
path (``transformers.utils.generic.is_flash_attention_requested`` tests for the substring)."""

MIN_TRANSFORMERS = "5.15"
"""The lowest transformers whose Qwen-VL towers accept every precomputed metadata keyword encgraph passes, an
integer ``max_seqlen`` / ``max_window_seqlen`` among them (5.15; 5.14 still computes ``max_seqlen`` with
``.item()``), and hand ``cu_seq_lens_q/k`` and ``max_length_q/k`` to a "flash" attention function."""


SEGMENT_MIN_ROWS = 2048
"""Rows from which a sequence of an eager forward with host bounds runs as one dense SDPA call on CUDA where no
crossover was measured for its head geometry (:mod:`encgraph.models.kernel_choice` measures it at capture):
measured on an H200 at 16 heads x 72, dense cuDNN against Flash varlen per call is 0.33 vs 0.58 ms at 1 x 5120
rows and 0.46 vs 0.73 ms at 2 x 4096, about even at 4 x 1280, and 0.19 vs 0.08 ms at 16 x 256 (one launch per
sequence)."""


def _host_plan(cu_seqlens: torch.Tensor, query: torch.Tensor
               ) -> tuple[tuple[int, ...], tuple[bool, ...] | None] | None:
    """``(host bounds of cu_seqlens, per sequence whether it runs dense)`` when :func:`host_bounds` gave the bounds
    and at least one sequence runs dense in this call (``None`` for the flags: every sequence on its own, the
    CPU); else ``None`` (the backend of :func:`pick_backend`)."""
    found = sequence_bounds.lookup(cu_seqlens)
    if found is None:
        return None
    bounds, table = found
    if not bounds or bounds[0] != 0 or bounds[-1] > query.shape[0]:
        return None
    if pick_backend(query) is not AttentionBackend.VARLEN:
        return bounds, None  # the CPU (or no varlen kernel): every sequence on its own
    rows = sequence_bounds.dense_rows(query, table, SEGMENT_MIN_ROWS)
    flags = tuple(rows is not None and b - a >= rows for a, b in zip(bounds[:-1], bounds[1:]))
    return (bounds, flags) if any(flags) else None


class AttentionBackend(enum.Enum):
    """The kernel :func:`packed_attention` runs."""

    VARLEN = "varlen"
    """``torch.nn.attention.varlen.varlen_attn``: CUDA, fp16/bf16."""
    SEGMENTS = "segments"
    """SDPA per sequence, bounds read on the host: the CPU (never captured)."""
    MASKED_SDPA = "masked_sdpa"
    """SDPA with a block-diagonal boolean mask from ``cu_seqlens``: any device and dtype, tokens^2 memory."""


_VARLEN_OP: Callable[..., torch.Tensor] | None = None  # the custom op around it (encgraph.models._varlen_op)


def _varlen_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor,
                 cu_k: torch.Tensor, max_q: int, max_k: int, scale: float | None = None) -> torch.Tensor:
    """The varlen kernel of ``query``'s geometry (:func:`encgraph.models.varlen_kernel.kernel_of`), in
    ``varlen_attn``'s signature plus ``scale``; what the compiled path's opaque op calls (its shapes are concrete
    there).

    A compiled block run by an eager forward (the runner's compiled eager forward,
    :mod:`encgraph.capture.compiled_eager`) reaches here with the eager forward's own ``cu_seqlens`` tensor: its
    host bounds (:func:`host_bounds`) are found here, at run time, where the trace could not read them, so long
    sequences still run on the dense kernel. Inside a CUDA graph capture the lookup finds nothing."""
    # Self-attention only: the key's bounds must be the query's (the same tensor; the op may hand a new wrapper).
    same = cu_q.data_ptr() == cu_k.data_ptr() and cu_q.numel() == cu_k.numel()
    plan = _host_plan(cu_q, query) if same else None
    if plan is not None:
        return _host_planned_attention(query, key, value, cu_q, scale, *plan)
    return varlen_kernel.call_kernel(query, key, value, cu_q, cu_k, max_q, max_k, scale)


def _varlen() -> tuple[Callable[..., torch.Tensor] | None, bool]:
    """``(varlen_attn, takes_scale)`` of this torch build: :func:`encgraph.models.varlen_kernel.torch_varlen`."""
    return varlen_kernel.torch_varlen()


def pick_backend(query: torch.Tensor) -> AttentionBackend:
    """The backend for ``query``'s device and dtype (the same at capture and at replay)."""
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and _varlen()[0] is not None:
        return AttentionBackend.VARLEN
    if query.device.type == "cpu":
        return AttentionBackend.SEGMENTS
    return AttentionBackend.MASKED_SDPA


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None = None,
    backend: AttentionBackend | None = None,
) -> torch.Tensor:
    """Non-causal attention within each packed sequence.

    Args:
        query, key, value: ``(tokens, heads, head_dim)``, one dtype, on one device (key/value may have fewer
            heads, a divisor of the query heads).
        cu_seqlens: ``(slots,)`` int32 (int64 is converted) on the same device, non-decreasing, ``cu[0] == 0``;
            rows past ``cu[-1]`` are left unwritten by ``VARLEN``, so callers end the last sequence at ``tokens``.
        max_seqlen: the longest sequence any call at this shape may see (a host int, baked into a captured
            kernel); only ``VARLEN`` reads it.
        scale: softmax scale, default ``head_dim ** -0.5``.
        backend: force a backend; default :func:`pick_backend`.

    Returns:
        ``(tokens, heads, head_dim)`` in ``query``'s dtype, a fresh tensor. Never syncs the host.
    """
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise InputError(
            f"packed_attention: expected query, key, value of shape (tokens, heads, head_dim), got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}."
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise InputError(
            f"packed_attention(cu_seqlens): expected a 1-D int32 tensor, got {cu_seqlens.dtype} of shape "
            f"{tuple(cu_seqlens.shape)}."
        )
    # A symbolic size (torch.SymInt) is a host int too: a static forward compiled once for every budget derives
    # the full-attention max_seqlen from the buffers' shapes.
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, torch.SymInt)) or max_seqlen < 1:
        raise InputError(
            f"packed_attention(max_seqlen): expected a host int >= 1 fixed per layer at capture, got "
            f"{describe(max_seqlen)}; a tensor here would sync the host inside the graph."
        )
    plan = _host_plan(cu_seqlens, query) if backend is None else None
    if plan is not None:
        return _host_planned_attention(query, key, value, cu_seqlens, scale, *plan)
    backend = pick_backend(query) if backend is None else backend
    if backend is AttentionBackend.VARLEN:
        return _varlen_attention(query, key, value, cu_seqlens, max_seqlen, scale)
    if key.shape[1] != query.shape[1]:
        key, value = repeat_heads(key, value, query.shape[1])
    if backend is AttentionBackend.SEGMENTS:
        return segment_attention(query, key, value, cu_seqlens, scale)
    return masked_attention(query, key, value, cu_seqlens, scale)


def _varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None,
    kernel: str | None = None,
    keys: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """One varlen call; ``kernel`` forces one of ``"flash"``, ``"fa4"``, ``"cudnn"`` (capture's measurement),
    default the geometry's (:func:`encgraph.models.varlen_kernel.kernel_of`). ``keys``: the keys' own
    ``(cu_seqlens, max_seqlen)`` where they are not the queries' (:func:`attend_per_sequence`)."""
    if _varlen()[0] is None:
        raise ConfigError(
            "packed_attention(backend=VARLEN): this torch build has no torch.nn.attention.varlen (torch>=2.10); "
            "use backend=MASKED_SDPA or upgrade torch."
        )
    # Flash kernels need the head dim contiguous; other strides are free (a copy per layer would cost more than
    # the attention itself at small batches).
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    cu_k, max_k = (cu, max_seqlen) if keys is None else (keys[0].to(torch.int32), keys[1])
    kwargs: dict[str, Any] = {}
    if key.shape[1] != query.shape[1]:
        key, value = repeat_heads(key, value, query.shape[1])
    if torch.compiler.is_compiling():
        # Traced by torch.compile: one opaque op (see encgraph.models._varlen_op) around _varlen_call, which picks
        # the geometry's kernel at run time; the scale passed as it is (under a symbolic head dim the
        # default-scale test of varlen_kernel.call_kernel would be a graph break: math.isclose of a SymFloat).
        op = _VARLEN_OP
        if op is None:
            raise ConfigError("packed_attention: register_attention() must run before torch.compile traces it.")
        if scale is not None:
            kwargs["scale"] = float(scale)
        return op(query, key, value, cu, cu_k, max_seqlen, max_k, **kwargs)
    return varlen_kernel.call_kernel(query, key, value, cu, cu_k, max_seqlen, max_k, scale, kernel)


def attend_per_sequence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_seqlen: int, *, scale: float | None = None) -> torch.Tensor:
    """One query per ``cu_seqlens`` slot attending to its own sequence's rows: ``query`` ``(slots - 1, heads,
    head_dim)`` (``slots`` the length of ``cu_seqlens``), ``key``/``value`` ``(tokens, heads, head_dim)``, packed as
    in :func:`packed_attention`. One varlen call whose queries' bounds are ``0, 1, ..., slots - 1`` (made on the
    device) and whose keys' are ``cu_seqlens``: each sequence's keys are read once, and nothing crosses sequences,
    so a non-finite row reaches only its own sequence's query; a zero-length slot's output is zero. CUDA in
    fp16/bf16 only (:func:`pick_backend` ``VARLEN``; callers use a masked SDPA elsewhere). Never syncs the host."""
    if pick_backend(query) is not AttentionBackend.VARLEN:
        raise ConfigError(
            f"attend_per_sequence(query): expected a CUDA fp16/bf16 tensor with torch's varlen kernel present, got "
            f"{query.dtype} on {query.device}; use a masked SDPA there (encgraph.models.idefics3_layout does)."
        )
    slots = cu_seqlens.shape[0]
    if query.dim() != 3 or query.shape[0] != slots - 1:
        raise InputError(
            f"attend_per_sequence(query): expected ({slots - 1}, heads, head_dim), one query per sequence of "
            f"cu_seqlens, got {tuple(query.shape)}."
        )
    cu_q = torch.arange(slots, dtype=torch.int32, device=query.device)
    return _varlen_attention(query, key, value, cu_q, 1, scale, keys=(cu_seqlens, max_seqlen))


def _host_planned_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None,
    bounds: Sequence[int], dense: Sequence[bool] | None,
) -> torch.Tensor:
    """Each sequence flagged in ``dense`` as one dense SDPA call (:func:`dense_sequence`); each run of the others
    between them as one varlen call over its rows (its ``cu_seqlens`` a slice of the device tensor minus its first
    value: no host-to-device copy, no sync). ``dense is None``: every sequence on its own (the CPU's
    ``SEGMENTS``). Returns a fresh tensor."""
    if dense is None:
        if key.shape[1] != query.shape[1]:
            key, value = repeat_heads(key, value, query.shape[1])
        return segment_attention(query, key, value, cu_seqlens, scale, bounds)
    tokens = query.shape[0]
    out = query.new_empty(query.shape)
    dense_k, dense_v = repeat_heads(key, value, query.shape[1]) if key.shape[1] != query.shape[1] else (key, value)
    run: int | None = None  # the cu index where the current run of varlen sequences starts

    def flush(end: int) -> None:
        a, b = bounds[run], bounds[end]
        if b > a:
            longest = max(y - x for x, y in zip(bounds[run:end], bounds[run + 1:end + 1]))
            cu = cu_seqlens[run:end + 1] - cu_seqlens[run]
            out[a:b] = _varlen_attention(query[a:b], key[a:b], value[a:b], cu, longest, scale)

    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        if dense[i]:
            if run is not None:
                flush(i)
                run = None
            out[a:b] = dense_sequence(query[a:b], dense_k[a:b], dense_v[a:b], scale)
        elif run is None:
            run = i
    if run is not None:
        flush(len(bounds) - 1)
    if bounds[-1] < tokens:  # rows past cu[-1] (none in encgraph's layouts) attend among themselves
        a = bounds[-1]
        out[a:] = dense_sequence(query[a:], dense_k[a:], dense_v[a:], scale)
    return out


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function registered as :data:`ATTENTION_NAME`, with transformers' attention-interface signature.

    ``query``/``key``/``value``: ``(1, heads, tokens, head_dim)``; the packed path reads ``cu_seq_lens_q`` (and
    ``cu_seq_lens_k``, which must be the same tensor: vision self-attention) and ``max_length_q``. Returns
    ``((1, tokens, heads, head_dim), None)`` as transformers' flash functions do. Without ``cu_seq_lens_q`` (a
    module that does not pack) it runs plain SDPA with ``attention_mask``.
    """
    if dropout:
        raise ConfigError(
            f"{ATTENTION_NAME}: attention dropout is not supported (got {dropout}); call module.eval() first, "
            "encgraph runs inference only."
        )
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is None:
        is_causal = bool(kwargs.get("is_causal") or False) and attention_mask is None and query.shape[2] > 1
        if key.shape[1] != query.shape[1]:
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, is_causal=is_causal
        )
        return out.transpose(1, 2), None
    if kwargs.get("is_causal"):
        raise ConfigError(f"{ATTENTION_NAME}: packed causal attention is not supported; it serves vision towers.")
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu_q:
        raise ConfigError(f"{ATTENTION_NAME}: cu_seq_lens_k must be cu_seq_lens_q (self-attention only).")
    if query.shape[0] != 1:
        raise InputError(f"{ATTENTION_NAME}: packed inputs have batch size 1, got {query.shape[0]}.")
    max_seqlen = kwargs.get("max_length_q")
    if max_seqlen is None or isinstance(max_seqlen, torch.Tensor):
        # Only eager callers get here (encgraph's static forwards always pass a host int): read it once.
        max_seqlen = int((cu_q[1:] - cu_q[:-1]).max()) if cu_q.numel() > 1 else 1
    elif not isinstance(max_seqlen, torch.SymInt):
        max_seqlen = max(int(max_seqlen), 1)  # never int() a symbolic size: that would specialise it
    out = packed_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu_q,
        max_seqlen,
        scale=scaling,
    )
    return out.unsqueeze(0), None


def register_attention() -> str:
    """Register :func:`hf_attention_forward` as :data:`ATTENTION_NAME` with ``transformers.AttentionInterface``
    (idempotent) and return the name. Raises :class:`~encgraph.VersionError` below :data:`MIN_TRANSFORMERS`."""
    require_transformers(MIN_TRANSFORMERS, "encgraph's packed attention for Hugging Face towers")
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, hf_attention_forward)
    global _VARLEN_OP
    varlen, _ = _varlen()  # resolved here, eagerly, so that a compiled forward only reads the memo
    if varlen is not None and _VARLEN_OP is None:
        from encgraph.models._varlen_op import make_op

        _VARLEN_OP = make_op(_varlen_call, True)  # defined outside any trace
    return ATTENTION_NAME


def use_packed_attention(module: torch.nn.Module) -> AttentionSwitch:
    """Switch every config of the tower ``module`` to :data:`ATTENTION_NAME`; ``.restore()`` on the returned
    switch undoes it (adapters call it from ``unwrap()``)."""
    return switch_attention(module, register_attention())
