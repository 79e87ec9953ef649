"""One long attention sequence through dense SDPA, at its own length or padded to a bucket's.

An eager forward with host bounds (:mod:`encgraph.models.attention`) runs each long sequence as one dense SDPA
call: on an H200 torch picks cuDNN's kernel (346-428 TF/s at head dim 72-80 against Flash varlen's 207-258), whose
plan is built per exact shape (about 35 ms, then kept per thread). :func:`padded_dense` runs a sequence at a
bucket length instead (:func:`~encgraph.packing.kernels.bucket_rows`), the padding masked exactly, so that one plan
serves every length of the bucket; which geometries do so is measured (:mod:`encgraph.models.kernel_choice`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["MASK_LOGIT", "dense_sequence", "padded_dense"]


def dense_sequence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
    """One sequence ``(rows, heads, head_dim)`` through dense SDPA in the ``(1, heads, rows, head_dim)`` layout of
    the towers' own SDPA calls (transposed views: on an H200 torch runs cuDNN's kernel for them, the layout the
    crossover is measured in); returns ``(rows, heads, head_dim)``."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    return F.scaled_dot_product_attention(q, k, v, scale=scale)[0].transpose(0, 1)


MASK_LOGIT = 1.0e4
"""The logit of a query against a padding key in :func:`padded_dense` (negated): its weight is exp(-1e4), 0."""


def padded_dense(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, padded: int
) -> torch.Tensor:
    """One sequence ``(rows, heads, head_dim)`` through dense SDPA at ``padded >= rows`` rows, so that one cuDNN
    plan (built per exact shape, about 35 ms on an H200) serves every length of a bucket
    (:func:`~encgraph.packing.kernels.bucket_rows`); ``padded == rows`` is :func:`dense_sequence`.

    The padding rows are zeros and one more head-dim column (the width rounded up to a multiple of 8, the
    kernel's alignment) masks them as keys: real queries carry ``MASK_LOGIT / scale`` there, padding keys -1, real
    keys and values 0. A real query's logit against a real key is exactly its own (the extra products are 0),
    against a padding key ``-MASK_LOGIT``: weight 0. Padding queries' rows are dropped. The scale is the
    sequence's own (``1 / sqrt(head_dim)`` by default, not the widened one's). Returns ``(rows, heads, head_dim)``;
    the padded copies (about ``padded x heads x width`` elements each, three of them) live for the call."""
    rows, heads, dim = query.shape
    if padded <= rows:
        return dense_sequence(query, key, value, scale)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    width = -(-(dim + 1) // 8) * 8
    q, k, v = (query.new_zeros(padded, heads, width) for _ in range(3))
    q[:rows, :, :dim] = query
    q[:rows, :, dim] = MASK_LOGIT / scale
    k[:rows, :, :dim] = key
    k[rows:, :, dim] = -1.0
    v[:rows, :, :dim] = value
    return dense_sequence(q, k, v, scale)[:rows, :, :dim]
