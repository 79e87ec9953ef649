"""How busy the GPU was during a measured run, from NVML's utilization as ``nvidia-smi`` reports it.

``utilization.gpu`` is the share of the last sample period (1/6 s to 1 s, by product) in which one or more kernels
ran on the device: a kernel that keeps a few SMs busy counts as fully busy, so 100% means "never idle", not "at
the device's rate". For a server that is what tells the two bounds apart: a device idle a third of the time waits
for the host (HTTP, decoding, preprocessing, Python around each request); a device never idle is the limit, and
only a faster tower (or a larger batch) serves more.

:class:`GpuBusy` samples it every ``interval_ms`` for ``seconds`` after ``delay`` (the load's warm-up), in an
``nvidia-smi --loop-ms`` child of this process, and :meth:`GpuBusy.result` gives the mean, the median and the share
of samples at 100%, or ``{"skipped": why}`` (no ``nvidia-smi``, no sample). It reads the whole device, so other
processes' kernels count too: run nothing else on the GPU.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
import time
from typing import Any

__all__ = ["GpuBusy", "merge_busy", "nvml_index", "parse_samples", "summarize_busy"]


def nvml_index(cuda_index: int, visible: str | None = None) -> int:
    """The ``nvidia-smi --id`` of torch's CUDA device ``cuda_index``: its entry in ``CUDA_VISIBLE_DEVICES``
    (``visible``; read from the environment when None) where that lists indices, else ``cuda_index`` (nvidia-smi
    ignores the variable)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    entries = [e.strip() for e in (visible or "").split(",") if e.strip()]
    if cuda_index < len(entries) and entries[cuda_index].isdigit():
        return int(entries[cuda_index])
    return cuda_index


def parse_samples(text: str) -> list[float]:
    """The utilization percentages of ``nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits``
    output, one per line; lines that are not a number (``[N/A]``, a blank) are left out."""
    out = []
    for line in text.splitlines():
        try:
            out.append(float(line.strip()))
        except ValueError:
            continue
    return out


def summarize_busy(samples: list[float]) -> dict[str, Any]:
    """The mean and median of ``samples`` (percent) and the share of them at 100%; ``{"skipped": ...}`` without
    any."""
    if not samples:
        return {"skipped": "nvidia-smi gave no utilization sample"}
    return {"busy_pct_mean": round(statistics.fmean(samples), 1), "busy_pct_p50": round(statistics.median(samples), 1),
            "share_at_100": round(sum(s >= 100.0 for s in samples) / len(samples), 3), "samples": len(samples)}


def merge_busy(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' :meth:`GpuBusy.result` pooled (weighted by their samples; the medians' median); the first
    ``skipped`` where no run has samples."""
    runs = [r for r in results if r.get("samples")]
    if not runs:
        return next((r for r in results if "skipped" in r), {"skipped": "no run"})
    n = sum(r["samples"] for r in runs)
    return {"busy_pct_mean": round(sum(r["busy_pct_mean"] * r["samples"] for r in runs) / n, 1),
            "busy_pct_p50": round(statistics.median(r["busy_pct_p50"] for r in runs), 1),
            "share_at_100": round(sum(r["share_at_100"] * r["samples"] for r in runs) / n, 3), "samples": n}


class GpuBusy:
    """Samples device ``index``'s utilization for ``seconds`` after ``delay``, started at construction; call
    :meth:`result` once, after the run (it waits for the sampling to end)."""

    def __init__(self, seconds: float, delay: float = 0.0, index: int = 0, interval_ms: int = 100,
                 tool: str | None = "nvidia-smi") -> None:
        if seconds <= 0 or delay < 0 or interval_ms <= 0:
            raise ValueError(f"GpuBusy: expected seconds > 0, delay >= 0 and interval_ms > 0, got seconds={seconds}, "
                             f"delay={delay}, interval_ms={interval_ms}.")
        self.seconds, self.index, self.interval_ms = seconds, index, interval_ms
        self.tool = shutil.which(tool) if tool else None
        self._text = ""
        self._error: str | None = None
        self._thread = threading.Thread(target=self._sample, args=(delay,), daemon=True, name="gpu-busy")
        if self.tool is not None:
            self._thread.start()

    def _sample(self, delay: float) -> None:
        time.sleep(delay)
        assert self.tool is not None
        try:
            proc = subprocess.Popen([self.tool, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                     f"--loop-ms={self.interval_ms}", f"--id={self.index}"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError as e:
            self._error = f"{self.tool} did not start: {e}"
            return
        try:
            self._text, _ = proc.communicate(timeout=self.seconds)
        except subprocess.TimeoutExpired:  # the end of the window: what it printed so far is the samples
            proc.terminate()
            self._text, _ = proc.communicate()
        else:
            self._error = f"{self.tool} exited {proc.returncode} before the window's end: {self._text.strip()[-300:]}"

    def result(self) -> dict[str, Any]:
        if self.tool is None:
            return {"skipped": "nvidia-smi is not on PATH"}
        self._thread.join()
        if self._error is not None:
            return {"skipped": self._error}
        return summarize_busy(parse_samples(self._text))
