"""The exact attention of :func:`~encgraph.models.attention.packed_attention` outside the varlen kernel, for any
device and dtype: each packed sequence through SDPA on its own (:func:`segment_attention`: the CPU's backend, and
the rows an eager forward leaves past ``cu[-1]``), one long sequence of an eager forward through dense SDPA in the
towers' own layout (:func:`dense_sequence`), or one SDPA call under a block-diagonal mask
(:func:`masked_attention`: CUDA in fp32, where varlen is missing, and the ``meta`` device); and the head repeat of
grouped keys they take.

Layout as :mod:`encgraph.models.attention`'s: ``(tokens, heads, head_dim)`` packed, ``cu_seqlens`` bounding the
sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from encgraph.errors import InputError

__all__ = ["dense_sequence", "masked_attention", "repeat_heads", "segment_attention"]


def dense_sequence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
    """One sequence ``(rows, heads, head_dim)`` through dense SDPA in the ``(1, heads, rows, head_dim)`` layout of
    the towers' own SDPA calls (transposed views: on an H100 or H200 torch runs cuDNN's kernel for them, the layout
    the crossover is measured in); returns ``(rows, heads, head_dim)``."""
    four = [t.transpose(0, 1).unsqueeze(0) for t in (query, key, value)]
    return F.scaled_dot_product_attention(*four, scale=scale)[0].transpose(0, 1)


def repeat_heads(key: torch.Tensor, value: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    if heads % key.shape[1]:
        raise InputError(
            f"packed_attention: query heads ({heads}) must be a multiple of key/value heads ({key.shape[1]})."
        )
    groups = heads // key.shape[1]
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def segment_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None,
    bounds: Sequence[int] | None = None,
) -> torch.Tensor:
    # key and value have the query's heads here (packed_attention repeats grouped ones).
    tokens = query.shape[0]
    if bounds is None:
        bounds = cu_seqlens.tolist()  # the CPU only: a host read costs nothing and nothing is captured
    out = query.new_empty(query.shape)
    # (1, heads, tokens, head_dim): the 4-D layout torch's CPU flash kernel takes (3-D inputs fall back to the
    # math kernel, whose (tokens, tokens) scores a long padding sequence cannot afford).
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    ends = sorted({min(max(int(e), 0), tokens) for e in bounds} | {0, tokens})
    for start, end in zip(ends[:-1], ends[1:]):
        # Rows past cu[-1] (none in encgraph's layouts) form one more sequence, as in the masked backend.
        out[start:end] = F.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], scale=scale
        )[0].transpose(0, 1)
    return out


def masked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None
) -> torch.Tensor:
    # key and value have the query's heads here (packed_attention repeats grouped ones).
    tokens = query.shape[0]
    # Segment id of each row: the number of sequence ends at or before it. Zero-length sequences add equal ends
    # and so never split a segment; rows past cu[-1] share one extra segment (they attend among themselves).
    rows = torch.arange(tokens, device=query.device, dtype=cu_seqlens.dtype)
    seg = torch.searchsorted(cu_seqlens[1:].contiguous(), rows, right=True)
    mask = seg[:, None] == seg[None, :]
    # Another sequence's NaN or inf reaches a row through the masked product (a -inf mask plus an inf score, or a
    # zero weight times an inf value, is NaN): compute on finite keys and values only, then make NaN exactly the
    # rows whose own sequence holds a non-finite key or value, as the attention of that sequence alone would.
    zero = torch.zeros((), dtype=value.dtype, device=value.device)
    bad_k, bad_v = ~torch.isfinite(key), ~torch.isfinite(value)
    bad = (bad_k | bad_v).reshape(tokens, -1).any(-1)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        torch.where(bad_k, zero, key).transpose(0, 1).unsqueeze(0),
        torch.where(bad_v, zero, value).transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
    )[0].transpose(0, 1)
    reach = (mask & bad[None, :]).any(-1)  # (tokens,): the row's sequence holds a non-finite key or value
    return torch.where(reach[:, None, None], torch.full((), float("nan"), dtype=out.dtype, device=out.device), out)
