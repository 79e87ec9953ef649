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


ERROR_CHUNK = 1 << 20
"""Elements per step of :func:`relative_error` (float32 temporaries of 4 MiB each)."""


def relative_error(static: torch.Tensor, eager: torch.Tensor) -> float:
    """``||static - eager|| / ||eager||`` over the entries where ``eager`` is finite; ``inf`` for a shape mismatch
    or a non-finite ``static`` entry where ``eager`` is finite.

    Computed on the accelerator where either tensor lives (the host only when both are there): the self-check's
    references wait on the host while its replays' outputs are on the device, and float64 arithmetic on a host that
    other work keeps busy is slow (an H100, a Qwen-like tower's 20 budgets: the self-check's replay check took
    7.05 s beside another process's compiles, against 1.27 s alone, almost all of it this comparison on the CPU).
    :data:`ERROR_CHUNK` elements at a time, in float32 (float64 for float64 inputs) with float64 sums, so that it adds
    a few small chunks to the device's memory, never float copies of both tensors (each twice a bf16 output or
    more). One host read at the end."""
    if static.shape != eager.shape:
        return math.inf
    on = static.device if static.device.type != "cpu" else eager.device
    work = torch.float64 if torch.float64 in (static.dtype, eager.dtype) else torch.float32
    a, b = static.detach().reshape(-1), eager.detach().reshape(-1)
    diff_sq = torch.zeros((), dtype=torch.float64, device=on)
    ref_sq = torch.zeros((), dtype=torch.float64, device=on)
    bad = torch.zeros((), dtype=torch.bool, device=on)
    for start in range(0, b.numel(), ERROR_CHUNK):
        y = b[start:start + ERROR_CHUNK].to(on, work)
        x = a[start:start + ERROR_CHUNK].to(on, work)
        finite = torch.isfinite(y)
        y = torch.where(finite, y, 0.0)
        x = torch.where(finite, x, 0.0)  # entries where eager is not finite are not compared
        bad |= ~torch.isfinite(x).all()
        diff_sq += (x - y).square().sum(dtype=torch.float64)
        ref_sq += y.square().sum(dtype=torch.float64)
    diff_sq_, ref_sq_, bad_ = torch.stack([diff_sq, ref_sq, bad.double()]).tolist()  # the one host read
    if bad_:
        return math.inf
    diff, ref = math.sqrt(diff_sq_), math.sqrt(ref_sq_)
    return diff / ref if ref > 0 else diff
