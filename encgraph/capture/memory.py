"""How much a phase of a capture raised the device's peak memory: what ``capture_info["memory_peak_rise_mib"]``
reports per phase (the graphs with their compile and warm-up runs; the self-check and the cost model's timings).

The process's peak counters are never reset (they are the user's, who may be measuring their own peak): a phase's
figure is how far it pushed the peak above where it stood before, so 0 means the phase stayed under an earlier
peak, not that it allocated nothing. ``reserved`` counts what the caching allocator holds from the driver (graph
pools included); ``allocated`` the live tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["peak_rise", "release_cached"]


@contextlib.contextmanager
def peak_rise(device: torch.device | None, into: dict[str, dict[str, float]], phase: str) -> Iterator[None]:
    """Record in ``into[phase]`` how far the block raised ``device``'s peak reserved and allocated bytes (MiB);
    nothing off CUDA (``device`` None or not a CUDA device)."""
    if device is None or device.type != "cuda":
        yield
        return
    before = _peaks(device)
    yield
    after = _peaks(device)
    into[phase] = {k: round(max(after[k] - before[k], 0) / 2**20, 1) for k in before}


def _peaks(device: torch.device) -> dict[str, int]:
    stats = torch.cuda.memory_stats(device)
    return {"reserved": int(stats.get("reserved_bytes.all.peak", 0)),
            "allocated": int(stats.get("allocated_bytes.all.peak", 0))}


def release_cached(device: torch.device) -> None:
    """Give the driver back the caching allocator's wholly free segments (``torch.cuda.empty_cache()``; the
    graphs' pool is the graphs' and stays), between the self-check's samples: each sample's eager forward runs at
    another size, and the segments cached for one fit the next one's blocks only in part, so that without this
    the reserved memory grows past any one forward's (HF ViT-B/16 on an H100: +550 MiB reserved for +217 MiB
    allocated over the self-check). torch's own capture empties the cache the same way before each graph.
    Capture-time only (it synchronises the device); nothing off CUDA."""
    if device.type == "cuda":
        with torch.cuda.device(device):  # empty_cache acts on the current device
            torch.cuda.empty_cache()
