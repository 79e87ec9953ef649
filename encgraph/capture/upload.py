"""Host tensors to a CUDA device without making the host wait for the device's queued work.

A ``non_blocking`` copy from pageable host memory is not asynchronous: the driver stages it through its own pinned
buffer and may wait for the stream to reach the copy, i.e. for every replay already queued on it (the previous
call's, in a server that keeps two calls in flight). A copy from pinned memory is queued and returns. torch's
caching host allocator records an event on the copy's stream for a block ``pin_memory()`` made, so the pinned
temporary may be dropped at once: its block is reused only once the copy is done.

A type change or a non-contiguous source in a host-to-device ``copy_`` makes torch convert on the host into a new
pageable temporary; both happen here first, on the host, before pinning. Only outside a graph capture (a pinned
temporary's address must not be recorded into a graph).
"""

from __future__ import annotations

import torch

__all__ = ["copy_into", "to_device"]


def _pinned(host: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``host`` as a contiguous ``dtype`` tensor in pinned memory (itself when it already is one)."""
    staged = host.to(dtype=dtype).contiguous()
    return staged if staged.is_pinned() else staged.pin_memory()


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``; to a CUDA device from the CPU through pinned memory, without blocking."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return _pinned(host, host.dtype).to(device, non_blocking=True)


def copy_into(view: torch.Tensor, value: torch.Tensor) -> None:
    """``view.copy_(value)``, from the CPU to a CUDA ``view`` through pinned memory, without blocking."""
    if view.device.type == "cuda" and value.device.type == "cpu":
        value = _pinned(value, view.dtype)
    view.copy_(value, non_blocking=True)
