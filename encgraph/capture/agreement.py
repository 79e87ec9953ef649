"""How closely two runs of one forward must agree, and how that is measured: the self-check's padded replay
against the eager forward, the compiled eager forward's check, and the generic adapter's split check all use
:func:`relative_error` against :func:`tolerance`."""

from __future__ import annotations

import math

import torch

__all__ = ["ERROR_CHUNK", "relative_error", "tolerance"]


def tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """Norm-relative agreement expected between the padded static forward and the eager forward."""
    if dtype in (torch.float16, torch.bfloat16):
        return 5e-2  # different kernels (max_seqlen, batch shape) round 2-byte floats differently
    if device.type == "cuda":
        return 1e-2  # TF32 matmuls may be on
    return 1e-3


ERROR_CHUNK = 1 << 22
"""Elements per step of :func:`relative_error` (float64 temporaries of 32 MiB each)."""


def relative_error(static: torch.Tensor, eager: torch.Tensor) -> float:
    """``||static - eager|| / ||eager||`` in float64 over the entries where ``eager`` is finite, computed where
    ``eager`` lives (the self-check's references are on the host; the compiled eager check's on the device);
    ``inf`` for a shape mismatch or a non-finite ``static`` entry where ``eager`` is finite.

    Computed :data:`ERROR_CHUNK` elements at a time, so that the comparison adds a few float64 chunks to the
    device's memory rather than float64 copies of both tensors and their difference (each four times a bf16
    output: 0.2 GiB for SigLIP-so400m's last_hidden_state at 32 images; on an H100 the self-check's eager phase
    raised that capture's peak 1.2 GiB above its warm-up's). One host read at the end."""
    if static.shape != eager.shape:
        return math.inf
    a, b = static.detach().reshape(-1), eager.detach().reshape(-1)
    diff_sq = b.new_zeros((), dtype=torch.float64)
    ref_sq = b.new_zeros((), dtype=torch.float64)
    bad = b.new_zeros((), dtype=torch.bool)
    for start in range(0, b.numel(), ERROR_CHUNK):
        y = b[start:start + ERROR_CHUNK].double()
        x = a[start:start + ERROR_CHUNK].to(b.device, torch.float64)
        finite = torch.isfinite(y)
        y = torch.where(finite, y, 0.0)
        x = torch.where(finite, x, 0.0)  # entries where eager is not finite are not compared
        bad |= ~torch.isfinite(x).all()
        diff_sq += (x - y).square().sum()
        ref_sq += y.square().sum()
    if bool(bad):
        return math.inf
    diff, ref = math.sqrt(float(diff_sq)), math.sqrt(float(ref_sq))
    return diff / ref if ref > 0 else diff
