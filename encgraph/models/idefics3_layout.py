"""Host-side geometry of the Idefics3 / SmolVLM tower (:mod:`encgraph.models.idefics3`): which patches of a padded
batch are real, the tower's bucketised position ids, the attention of the padded patches, and the gather that puts
the packed rows back into the tower's padded layout.

The tower takes zero-padded images ``(B, C, H, W)`` and a ``patch_attention_mask`` ``(B, H/P, W/P)``. Its
processors mark a top-left rectangle of real patches per image (the pixel mask is ``[:h, :w]``, and a patch is real
where any of its pixels is), and its position ids are built for that shape: ``nb_h = mask[:, 0].sum()``,
``nb_w = mask[0, :].sum()``, then per real patch ``bucketize(row / nb_h) * side + bucketize(col / nb_w)`` against
``boundaries = arange(1/side, 1, 1/side)`` (``side = image_size / patch``), padded patches 0. Those ids are computed
here, on the host, the way the tower computes them: float32 steps and products (exact IEEE operations, the same on
any device), the tower's own boundaries read once from its device (``torch.arange`` of float32 accumulates in
float on CUDA and in double on the CPU: its values may differ in the last bit, and a fraction that falls on a
boundary then lands in another bucket), and transformers 5.15's cast of the fractions to the pixels' dtype.

A padded patch is a query that no real patch attends to (the mask hides it as a key), and all of an image's padded
patches hold the same input (a zero patch at position 0), so they leave the tower as one row repeated:
:func:`pad_query_attention` computes it, one query per image attending to the image's real rows.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.nn.functional as F

from encgraph.errors import InputError
from encgraph.models.attention import (
    AttentionBackend,
    attend_per_sequence,
    pick_backend,
)

__all__ = [
    "MaskedPixels",
    "NotRectangular",
    "bucket_positions",
    "casts_fractions",
    "needs_mask",
    "pad_query_attention",
    "padded_layout",
    "read_mask",
    "slot_mask",
    "slot_rows",
    "tower_boundaries",
]


class NotRectangular(InputError):
    """A ``patch_attention_mask`` whose real patches are not a top-left rectangle (or are none): the tower's
    position ids then follow its own rule; ``graphed(tower)`` leaves such a call to the tower."""


class MaskedPixels(InputError):
    """Masked patches whose pixels are not zero: each then leaves the tower as its own row, not the image's one
    padding row; ``graphed(tower)`` leaves such a call to the tower."""


def tower_boundaries(side: int, device: torch.device) -> np.ndarray:
    """The tower's ``boundaries`` as it computes them on ``device`` (read once; the CPU for ``meta``)."""
    device = torch.device("cpu") if device.type == "meta" else device
    return torch.arange(1 / side, 1.0, 1 / side, device=device).cpu().numpy()


def casts_fractions(embeddings: torch.nn.Module) -> bool:
    """Whether the tower's embeddings cast the fractional coordinates to the pixels' dtype before bucketising them
    (transformers 5.15; 5.25 keeps them float32): read from its own code."""
    try:
        source = inspect.getsource(type(embeddings).forward)
    except (OSError, TypeError):
        return False
    return "fractional_coords_h.to(pixel_values.dtype)" in source


def bucket_positions(heights: np.ndarray, widths: np.ndarray, y: np.ndarray, x: np.ndarray, side: int,
                     boundaries: np.ndarray, cast: torch.dtype | None) -> np.ndarray:
    """Position ids of real patches ``(y, x)`` of images of ``heights x widths`` real patches (per patch, int64
    arrays): ``bucketize(y / h) * side + bucketize(x / w)`` as the tower computes them (``cast``: the dtype 5.15
    rounds the fractions to, ``None``: float32)."""

    def bucket(index: np.ndarray, count: np.ndarray) -> np.ndarray:
        step = np.float32(1.0) / count.astype(np.float32)  # the tower's 1.0 / nb: a float32 reciprocal
        frac = np.minimum(index.astype(np.float32) * step, np.float32(1.0 - 1e-6))
        if cast is not None and cast != torch.float32:
            frac = torch.from_numpy(frac).to(cast).float().numpy()
        return np.searchsorted(boundaries, frac, side="right")

    return bucket(y, heights) * side + bucket(x, widths)


def read_mask(pixels: torch.Tensor, mask: torch.Tensor | None, patch: int) -> tuple[np.ndarray, bool]:
    """``(grid (n, 3) of (1, real rows, real cols), whether any image has padded patches)`` from the tower's
    arguments (``mask`` on the host, or on the pixels' device: one read of it). Only where some patch is padded is
    the device read again, for whether a masked patch holds a non-zero pixel.

    Raises :class:`NotRectangular` or :class:`MaskedPixels` (the tower's own forward then answers)."""
    n, _, height, width = pixels.shape
    rows, cols = height // patch, width // patch
    if mask is None:
        return np.tile(np.array([1, rows, cols], dtype=np.int64), (n, 1)), False
    real = mask.detach().bool().cpu().numpy()
    nh, nw = real[:, :, 0].sum(1), real[:, 0, :].sum(1)  # the tower's nb_patches_h / _w
    rect = (np.arange(rows)[None, :, None] < nh[:, None, None]) & (np.arange(cols)[None, None, :] < nw[:, None, None])
    bad = np.nonzero((real != rect).any(axis=(1, 2)) | (nh == 0) | (nw == 0))[0]
    if bad.size:
        raise NotRectangular(
            f"patch_attention_mask: image {int(bad[0])}'s real patches are not a top-left rectangle (the processors' "
            "layout); graphed(tower) leaves such a call to the tower."
        )
    padded = bool((nh * nw < rows * cols).any())
    if padded:
        cut = pixels[:, :, : rows * patch, : cols * patch].unflatten(3, (cols, patch)).unflatten(2, (rows, patch))
        nonzero = (cut != 0).any(dim=(1, 3, 5))  # (n, rows, cols): patches with a non-zero (or NaN) pixel
        stray = (nonzero & ~torch.from_numpy(real).to(nonzero.device)).flatten(1).any(1).cpu().numpy()
        if stray.any():
            raise MaskedPixels(
                f"pixel_values: image {int(np.nonzero(stray)[0][0])} has non-zero pixels in masked patches (the "
                "processors pad with zeros); graphed(tower) leaves such a call to the tower."
            )
    grid = np.stack([np.ones(n, dtype=np.int64), nh.astype(np.int64), nw.astype(np.int64)], axis=1)
    return grid, padded


def padded_layout(grid: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """The gather ``(n * rows * cols,)`` from ``cat([every image's real rows, one padding row per image])`` to the
    tower's layout ``(n, rows * cols)``: image ``j``'s real patch ``(y, x)`` is its packed row ``y * w + x``, every
    padded patch its padding row."""
    n = grid.shape[0]
    h, w = grid[:, 1], grid[:, 2]
    first = np.concatenate(([0], np.cumsum(h * w)[:-1]))
    y, x = np.arange(rows)[None, :, None], np.arange(cols)[None, None, :]
    real = (y < h[:, None, None]) & (x < w[:, None, None])
    packed = first[:, None, None] + y * w[:, None, None] + x
    padding = int((h * w).sum()) + np.arange(n)[:, None, None]
    return np.where(real, packed, padding).reshape(-1)


def slot_rows(cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """``(rows,)`` int64: each packed row's ``cu_seqlens`` slot. Built on the device from the buffer: nothing read
    back."""
    ends = cu_seqlens[1:].to(torch.int64)
    return torch.searchsorted(ends.contiguous(), torch.arange(rows, device=ends.device), right=True)


def slot_mask(cu_seqlens: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, seg)``: ``(slots, rows)`` bool, which packed rows each ``cu_seqlens`` slot's padding query attends
    to in the masked SDPA of :func:`pad_query_attention` (its own sequence's; a zero-length slot attends to row 0,
    so that every query has a key and stays finite), and :func:`slot_rows`. Built on the device: nothing read
    back."""
    ends = cu_seqlens[1:].to(torch.int64)
    slots = ends.shape[0]
    seg = slot_rows(cu_seqlens, rows)
    mask = seg[None, :] == torch.arange(slots, device=ends.device)[:, None]
    empty = ends == cu_seqlens[:-1].to(torch.int64)
    first = torch.arange(rows, device=ends.device)[None, :] == 0
    return mask | (empty[:, None] & first), seg


def needs_mask(query: torch.Tensor) -> bool:
    """Whether :func:`pad_query_attention` runs its masked SDPA for ``query``'s device and dtype (off torch's varlen
    path: the CPU, fp32), so that the caller builds :func:`slot_mask`'s mask once per forward."""
    return pick_backend(query) is not AttentionBackend.VARLEN


def pad_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                        scale: float, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """Each slot's padding query ``(slots, heads, dim)`` attending to its sequence's rows of ``key``/``value``
    (``(rows, heads, dim)``, bounded by ``cu_seqlens``; ``mask`` from :func:`slot_mask`, needed off the varlen
    path only: :func:`needs_mask`).

    On CUDA in fp16/bf16: one varlen call, queries bounded ``0, 1, ..., slots`` and keys by ``cu_seqlens``
    (:func:`~encgraph.models.attention.attend_per_sequence`): each sequence's keys read once, nothing crossing
    sequences. Measured on an H100 at SmolVLM2's 17 tiles of 729 rows, the masked SDPA below cost 8.0 ms of cuDNN
    and 1.3 ms of reductions a forward (27 layers) against the tiles' own attention's 8.6: a fifth of the forward.

    Elsewhere (the CPU, fp32): one SDPA call under ``mask``. A row whose key or value holds a non-finite value (its
    sum is not finite: also a finite row whose sum overflows) is zeroed for the product, so that it never reaches
    another sequence's query through a masked-out weight (``0 * NaN``), and the queries of its own sequence are
    NaN, as that sequence's own attention would make them."""
    if not needs_mask(query):
        return attend_per_sequence(query, key, value, cu_seqlens, max_seqlen, scale=scale)
    if mask is None:
        raise InputError("pad_query_attention(mask): off the varlen path the masked SDPA needs slot_mask's mask.")
    bad = ~torch.isfinite(key.sum(dim=(1, 2), dtype=torch.float32) + value.sum(dim=(1, 2), dtype=torch.float32))
    zero = torch.zeros((), dtype=key.dtype, device=key.device)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        torch.where(bad[:, None, None], zero, key).transpose(0, 1).unsqueeze(0),
        torch.where(bad[:, None, None], zero, value).transpose(0, 1).unsqueeze(0),
        attn_mask=mask, scale=scale,
    )[0].transpose(0, 1)
    reach = (mask & bad[None, :]).any(-1)
    return torch.where(reach[:, None, None], torch.full((), float("nan"), dtype=out.dtype, device=out.device), out)
