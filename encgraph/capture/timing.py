"""Host-side timing of device work: what the cost model and the capture's replay timings measure.

Capture may share its device with other work (another process capturing on the same GPU: issue 17's server,
timed while a neighbour captured, priced its replays so high that it served every item eagerly). Contention only
ever adds time, so a timing here is the **minimum** of spaced repeats (a burst of contention rarely covers every
one), and what the cost model compares is timed **interleaved** (one run of each in turn, every round), so that a
slow spell weighs on both sides alike instead of on whichever was timed during it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["PhaseClock", "time_host", "time_interleaved", "SPACING_S"]

SPACING_S = 0.002
"""Pause between rounds of repeats (seconds), so that they sample the device at different moments."""


def time_interleaved(fns: Sequence[Callable[[], Any]], repeats: int, device: torch.device,
                     spacing_s: float = SPACING_S) -> list[float]:
    """Per function of ``fns``, the minimum ms as the host sees it (``device`` synchronised around each run) over
    ``repeats`` rounds; each round runs every function once, in order, then pauses ``spacing_s``. One untimed run
    of each first (warm-up). ``device`` is the one the functions' work runs on, synchronised by name: the current
    device may be another (a runner on ``cuda:1`` while ``cuda:0`` is current)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    best = [float("inf")] * len(fns)
    with torch.inference_mode():
        for fn in fns:
            fn()
        for r in range(repeats):
            for i, fn in enumerate(fns):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                best[i] = min(best[i], (time.perf_counter() - t0) * 1e3)
            if spacing_s and r + 1 < repeats:
                time.sleep(spacing_s)
    return best


def time_host(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Minimum ms of ``fn`` over ``repeats`` spaced runs (see :func:`time_interleaved`): graph replays and eager
    forwards are measured alike, so the cost model compares like with like."""
    return time_interleaved([fn], repeats, device)[0]


class PhaseClock:
    """Wall seconds per named phase of capture-time work, summed over the phase's entries (``with
    clock("reference"): ...``); ``device`` (CUDA) is synchronised as each entry ends, so that the device work a
    phase queued is counted in that phase and not in the next. Capture-time only: the synchronisation is a host
    wait. :meth:`as_dict` rounds to milliseconds."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self._sync = device is not None and device.type == "cuda"
        self._device = device

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize(self._device)
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def as_dict(self) -> dict[str, float]:
        return {phase: round(s, 3) for phase, s in self.seconds.items()}
