"""Host-side timing of device work: what the cost model and the capture's replay timings measure."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["time_host"]


def time_host(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Median ms of ``fn`` as the host sees it (``device`` synchronised before and after; one untimed run first):
    graph replays and eager forwards are measured alike, so the cost model compares like with like."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        fn()
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))
