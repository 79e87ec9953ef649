"""One long attention sequence through dense SDPA, at its own length or padded to a bucket's.

An eager forward with host bounds (:mod:`encgraph.models.attention`) runs each long sequence as one dense SDPA
call: on an H200 torch picks cuDNN's kernel (346-428 TF/s at head dim 72-80 against Flash varlen's 207-258), whose
plan is built per exact shape (35-70 ms, then kept per thread). :func:`padded_dense` runs a sequence at a bucket
length instead (:func:`~encgraph.packing.kernels.bucket_rows`) and corrects its output exactly for the padding
keys, so that one plan serves every length of the bucket at any head dim; which geometries do so, and from which
length, is measured (:mod:`encgraph.models.kernel_choice`). :func:`counted_dense` makes the same correction with
the real length on the device, for a captured call whose one sequence's length changes from replay to replay.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

__all__ = ["counted_dense", "dense_sequence", "dense_with_lse", "padded_dense"]

_CUDNN, _FLASH = SDPBackend.CUDNN_ATTENTION.value, SDPBackend.FLASH_ATTENTION.value


def _four(t: torch.Tensor) -> torch.Tensor:
    """``(rows, heads, dim)`` as the ``(1, heads, rows, dim)`` view the towers' own SDPA calls pass."""
    return t.transpose(0, 1).unsqueeze(0)


def dense_sequence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
    """One sequence ``(rows, heads, head_dim)`` through dense SDPA in the ``(1, heads, rows, head_dim)`` layout of
    the towers' own SDPA calls (transposed views: on an H200 torch runs cuDNN's kernel for them, the layout the
    crossover is measured in); returns ``(rows, heads, head_dim)``."""
    return F.scaled_dot_product_attention(_four(query), _four(key), _four(value), scale=scale)[0].transpose(0, 1)


def dense_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`dense_sequence` through the kernel torch's SDPA picks for these inputs (its backend flags as found),
    also returning each query's log-sum-exp of its scaled logits: ``(out (rows, heads, head_dim) in the inputs'
    dtype, lse (heads, rows) float32)``. ``None`` where that kernel does not return one (memory-efficient or math
    SDPA): cuDNN and Flash on CUDA, Flash on the CPU do."""
    q, k, v = _four(query), _four(key), _four(value)
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, False, scale=scale)
    if choice == _CUDNN:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False,
                                                                      scale=scale)[:2]
    elif choice == _FLASH and q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    elif choice == _FLASH and q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    else:
        return None
    rows, heads = query.shape[:2]
    return out[0].transpose(0, 1), lse.reshape(heads, rows)  # cuDNN's lse is (1, heads, rows, 1)


def padded_dense(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, padded: int
) -> torch.Tensor:
    """One sequence ``(rows, heads, head_dim)`` through dense SDPA at ``padded >= rows`` rows, so that one cuDNN
    plan (built per exact shape, 35-70 ms on an H200) serves every length of a bucket
    (:func:`~encgraph.packing.kernels.bucket_rows`); ``padded == rows`` is :func:`dense_sequence`.

    The ``p = padded - rows`` padding keys are each head's mean key ``k̄`` with zero values, the padding queries
    zero (their rows are dropped). A real query's softmax then also counts ``p`` keys of logit ``s̄ = scale q·k̄``
    that add nothing to its weighted sum, so its padded output is the exact one times ``Z / (Z + p e^s̄)``, where
    ``Z`` sums its real keys' ``e^s`` and the kernel's log-sum-exp gives ``Z + p e^s̄``: dividing by
    ``1 - p e^(s̄ - lse)`` (in float32) restores it. The mean key makes that exact to float32 rounding (times at
    most ``padded / rows``): by Jensen ``Z >= rows e^s̄``, so the padding's share is at most ``p / padded`` (1/17
    at a bucket's widest) and nothing cancels, whatever the logits (zero keys would share ``p / (Z + p)``, near 1
    for a query whose every logit is very negative). The head dim is the sequence's own, so the kernel runs at
    the exact rate at 128 too (an extra masking column would widen it to 136, a slower cuDNN kernel). Where
    torch's SDPA picks a kernel that returns no log-sum-exp (:func:`dense_with_lse`), the sequence runs at its
    own length.

    Returns ``(rows, heads, head_dim)`` in the inputs' dtype, a view of the padded output (one more rounding than
    the unpadded kernel's: the correction). Buffers for the call: the three padded copies and the output
    (``padded x heads x head_dim`` each) and a float32 copy of the query for the padding logits.
    """
    rows, heads, dim = query.shape
    pad = padded - rows
    if pad <= 0:
        return dense_sequence(query, key, value, scale)
    scale = dim**-0.5 if scale is None else scale
    mean_key = key.mean(0, dtype=torch.float32).to(key.dtype)  # (heads, dim): the kernel sees this rounding
    k = torch.cat([key, mean_key.expand(pad, heads, dim)])
    q, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (query, value))
    found = dense_with_lse(q, k, v, scale)
    if found is None:  # memory-efficient or math SDPA: no log-sum-exp to correct with (and no per-shape plan)
        return dense_sequence(query, key, value, scale)
    out, lse = found
    return _without_padding(out[:rows], lse[:, :rows], query, mean_key, math.log(pad), scale)


def _without_padding(out: torch.Tensor, lse: torch.Tensor, query: torch.Tensor, mean_key: torch.Tensor,
                     log_pad: float | torch.Tensor, scale: float) -> torch.Tensor:
    """``out`` ``(rows, heads, head_dim)`` of a dense call whose keys included ``p`` padding keys ``k̄``
    (``mean_key``, ``(heads, head_dim)``) with zero values, divided in place by ``1 - p e^(s̄ - lse)`` (``lse``
    ``(heads, rows)`` float32, ``log_pad`` = log p, a host float or a 0-d device tensor; ``-inf`` for p = 0)."""
    # log(p e^(s̄ - lse)) = scale q·k̄ + log p - lse, (heads, rows, 1), in one batched product. Its inputs are
    # bf16/fp16 values, exact in float32 and in TF32 alike, so s̄ is the kernel's own logit to summation order
    # whatever the float32 matmul precision; few ops, as the host issues each (about 25 us apiece).
    log_share = torch.baddbmm(torch.sub(log_pad, lse[:, :, None]), query.transpose(0, 1).float(),
                              mean_key.float().unsqueeze(-1), alpha=scale)
    factor = torch.rsub(log_share.exp_(), 1.0).transpose(0, 1)  # 1 - share, at least rows / padded
    return out.div_(factor)  # computed in float32, rounded once to the inputs' dtype


def counted_dense(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, real_rows: torch.Tensor, scale: float | None
) -> torch.Tensor | None:
    """One sequence of the first ``real_rows`` of ``rows`` rows ``(rows, heads, head_dim)`` through one dense SDPA
    call at all ``rows``, the length a device tensor: the call a CUDA graph of one image can hold, where the image's
    rows change from replay to replay and the buffers' do not. Never syncs the host.

    The rows from ``real_rows`` on are padding: their keys become each head's mean real key ``k̄`` and their values
    zero (through ``torch.where``, so whatever they hold, NaN included, reaches no real row), and the kernel's
    log-sum-exp takes their share out of every real output exactly, as in :func:`padded_dense` (whose docs give the
    algebra), with ``p = rows - real_rows`` counted on the device (``p = 0``: the share's log is ``-inf``, the
    factor 1).

    Args:
        query, key, value: ``(rows, heads, head_dim)``, one dtype and head count (repeat grouped keys first).
        real_rows: an int tensor of one element on the same device, ``1 <= real_rows <= rows`` (a runner's
            ``cu_seqlens[1]`` for a batch of one single-frame item); not checked, as that would sync the host.
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        ``(rows, heads, head_dim)`` in the inputs' dtype, a fresh tensor: the first ``real_rows`` rows the
        sequence's attention (one more rounding than the unpadded kernel's: the correction), the rest unspecified.
        ``None`` where the kernel torch's SDPA picks returns no log-sum-exp (:func:`dense_with_lse`): the caller
        keeps its varlen call. Buffers for the call: masked copies of key and value, the output, and a float32
        copy of the query for the padding logits (``rows x heads x head_dim`` each).
    """
    rows, heads, dim = query.shape
    scale = dim**-0.5 if scale is None else scale
    count = real_rows.reshape(()).to(torch.float32)
    real = (torch.arange(rows, device=query.device) < real_rows.reshape(())).view(rows, 1, 1)
    mean_key = (torch.where(real, key, 0).sum(0, dtype=torch.float32) / count).to(key.dtype)  # the kernel's rounding
    found = dense_with_lse(query, torch.where(real, key, mean_key), torch.where(real, value, 0), scale)
    if found is None:
        return None
    out, lse = found
    return _without_padding(out, lse, query, mean_key, torch.log(rows - count), scale)
