"""Bicubic resampling of a small learned table as one weighted gather: GLM-4V's position embedding.

The GLM-4V towers (``Glm4vVisionEmbeddings``, and GLM-4.5V's identical ``Glm4vMoeVisionEmbeddings``) add to every
patch row a learned ``S x S`` position table (``S = 24``: 576 rows of the hidden size, 1536) resampled at the patch's
normalised coordinates by ``F.grid_sample(mode="bicubic", padding_mode="border", align_corners=False)`` in float32.
That kernel gives each output point one thread, which walks every channel in turn: with a few hundred points it
cannot fill the GPU. Measured on an H200 (``benches/kernel_profile.py``, GLM-4.1V-9B tower, torch 2.11), it took
3.15 ms of the 5.13 kernel ms of a captured 224 px image (256 patch rows) and 2.89 of 7.37 at 448 px: more than
the tower's 24 layers of attention and matrix products together at those sizes.

The same sum, written as what it is: each point reads a ``4 x 4`` neighbourhood of table rows (indices clamped to
the table: the border padding) with separable cubic-convolution weights (``A = -0.75``, as torch's), so
:func:`bicubic_border` is one ``F.embedding_bag`` (mode ``"sum"``, per-sample weights) of 16 table rows per point:
one kernel over points and channels, no ``points x 16 x channels`` intermediate. Float32 throughout; it differs
from ``grid_sample`` by the order of the 16 products' summation (float32 rounding: at most 1.3e-6 of the largest
value on random tables, on the CPU), before the tower rounds the embedding to its dtype.

:func:`position_embedding_gather` installs it on a GLM-4V embeddings module as a reversible rewrite
(:class:`~encgraph.models.layout.LayoutPatch`), applied by the GLM-4V adapter with the other layout rewrites.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from encgraph.models.layout import LayoutPatch

__all__ = ["CUBIC_A", "bicubic_border", "cubic_weights", "position_embedding_gather"]

CUBIC_A = -0.75
"""The cubic convolution coefficient of torch's bicubic modes (``grid_sample``, ``interpolate``)."""


def cubic_weights(t: torch.Tensor) -> torch.Tensor:
    """Cubic-convolution weights of the four neighbours at offsets -1, 0, 1, 2 of a point at fraction ``t`` (in
    ``[0, 1)``) past the second one: ``(*t.shape, 4)``, in ``t``'s dtype; they sum to 1."""
    a = CUBIC_A

    def near(x: torch.Tensor) -> torch.Tensor:  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x: torch.Tensor) -> torch.Tensor:  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return torch.stack((far(t + 1), near(t), near(1 - t), far(2 - t)), dim=-1)


def bicubic_border(table: torch.Tensor, height: int, width: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``F.grid_sample(image, grid, mode="bicubic", padding_mode="border", align_corners=False)`` of one
    ``(height, width)`` image of ``C`` channels at ``N`` points, as one weighted gather.

    Args:
        table: ``(height * width, C)`` float: the image's pixels row-major (pixel ``(r, c)`` is row
            ``r * width + c``), channels last.
        height, width: the image's size.
        x, y: ``(N,)`` float: the points' normalised coordinates (``-1`` and ``1`` the outer edges of the first and
            last pixel), ``x`` along the width; float32 in, float32 arithmetic.

    Returns:
        ``(N, C)`` in ``table``'s dtype: per point, the sum over its ``4 x 4`` neighbours (indices clamped into the
        image) of the pixel times its row's and its column's cubic weight. Temporaries: ``(N, 16)`` int64 indices
        and weights.
    """
    points = x.shape[0]
    ix = ((x + 1) * width - 1) / 2  # pixel coordinates, align_corners=False
    iy = ((y + 1) * height - 1) / 2
    x0, y0 = ix.floor(), iy.floor()
    wx, wy = cubic_weights(ix - x0), cubic_weights(iy - y0)
    # Made on the device (a host list would be copied in: a CUDA graph cannot capture that copy).
    offsets = torch.arange(-1, 3, device=x.device)
    cols = (x0.long().unsqueeze(1) + offsets).clamp_(0, width - 1)  # border padding: the edge pixel repeats
    rows = (y0.long().unsqueeze(1) + offsets).clamp_(0, height - 1)
    index = (rows.unsqueeze(2) * width + cols.unsqueeze(1)).reshape(points, 16)
    weights = (wy.unsqueeze(2) * wx.unsqueeze(1)).reshape(points, 16).to(table.dtype)
    return F.embedding_bag(index, table, per_sample_weights=weights, mode="sum")


def position_embedding_gather(embeddings: torch.nn.Module) -> LayoutPatch | None:
    """Rewrite a GLM-4V vision embeddings module's forward (``(embeddings (rows, hidden), lengths (sequences,),
    image_shapes (sequences, 3), h_coords (rows,), w_coords (rows,)) -> (rows, hidden)``) to resample its position
    table with :func:`bicubic_border` instead of ``F.grid_sample``. Each row's sequence is found on the device from
    ``lengths`` (the first whose end lies past the row), its ``(h, w)`` read from ``image_shapes``, its coordinates
    normalised as the tower does, and the float32 embedding rounded to the table's dtype before it is added.

    Returns ``None`` (nothing changed) where the module is not one of these: no square ``position_embedding`` table
    or a resampling mode other than bicubic.
    """
    table = getattr(getattr(embeddings, "position_embedding", None), "weight", None)
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or getattr(embeddings, "interpolated_method",
                                                                         None) != "bicubic":
        return None
    side = math.isqrt(table.shape[0])
    if side * side != table.shape[0]:
        return None

    def forward(hidden: torch.Tensor, lengths: torch.Tensor | list[int], image_shapes: torch.Tensor,
                h_coords: torch.Tensor, w_coords: torch.Tensor) -> torch.Tensor:
        weight = embeddings.position_embedding.weight
        if isinstance(lengths, list):
            lengths = torch.tensor(lengths, device=weight.device, dtype=torch.long)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        sequence = (rows.unsqueeze(0) >= lengths.cumsum(0).unsqueeze(1)).sum(0)
        height = image_shapes[sequence, 1].to(torch.float32)
        width = image_shapes[sequence, 2].to(torch.float32)
        x = ((w_coords + 0.5) / width) * 2 - 1
        y = ((h_coords + 0.5) / height) * 2 - 1
        position = bicubic_border(weight.to(torch.float32), side, side, x, y)
        return hidden + position.to(weight.dtype).to(hidden.device)

    return LayoutPatch(embeddings, "bicubic position embedding as one weighted gather", forward)
