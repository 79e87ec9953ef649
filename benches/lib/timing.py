"""Latency measurement (CUDA events around a call, or wall time on the CPU) and the matmul floor."""

from __future__ import annotations

import statistics
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from benches.lib.env import Env, free_memory, short_error

FLOOR_MATMUL_N = 8192
SMOKE_MATMUL_N = 256


@attrs.frozen
class Timing:
    """Samples of one measurement, in milliseconds."""

    samples_ms: tuple[float, ...]

    @property
    def median(self) -> float:
        return float(statistics.median(self.samples_ms))

    def percentile(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.samples_ms), q))

    def summary(self) -> dict[str, Any]:
        s = self.samples_ms
        return {
            "median_ms": round(self.median, 4),
            "mean_ms": round(float(np.mean(s)), 4),
            "p10_ms": round(self.percentile(10), 4),
            "p90_ms": round(self.percentile(90), 4),
            "min_ms": round(min(s), 4),
            "runs": len(s),
        }


def time_once(fn: Callable[[], Any], env: Env) -> float:
    """Milliseconds of one call of ``fn``, from before its first host step to the end of its device work.

    On CUDA: events recorded around the call (the device is synchronized first, so the start event fires when
    the host starts, and host gaps inside the call count); on the CPU: wall time.
    """
    import torch

    if env.cuda:
        torch.cuda.synchronize(env.device)
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return float(begin.elapsed_time(end))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_call(fn: Callable[[], Any], env: Env, *, runs: int | None = None, warmup: int | None = None) -> Timing:
    """``warmup`` untimed calls, then ``runs`` timed calls, each synchronized (latency, not throughput)."""
    for _ in range(env.warmup if warmup is None else warmup):
        fn()
    return Timing(tuple(time_once(fn, env) for _ in range(env.runs if runs is None else runs)))


def matmul_rate(env: Env, n: int | None = None) -> dict[str, Any]:
    """The measured dense matmul rate: median time of an ``n x n x n`` matmul on random data in ``env.dtype``
    (8192 on a GPU, 256 in the CPU smoke), as TFLOP/s (``2 n^3`` flops per matmul)."""
    import torch

    n = (SMOKE_MATMUL_N if env.tiny else FLOOR_MATMUL_N) if n is None else n
    gen = torch.Generator(device=env.device).manual_seed(env.seed)
    a = torch.randn(n, n, device=env.device, dtype=env.dtype, generator=gen)
    b = torch.randn(n, n, device=env.device, dtype=env.dtype, generator=gen)
    out = torch.empty(n, n, device=env.device, dtype=env.dtype)
    # At least one untimed call even under ``--warmup 0``: the first matmul of a process pays the BLAS thread
    # pool's start, which on a busy 2-core CI machine took over 67 ms for a 256^3 product and so measured a rate
    # that rounded to 0 TFLOP/s (a division by zero in floor_ms).
    timing = time_call(lambda: torch.matmul(a, b, out=out), env, warmup=max(1, env.warmup))
    tflops = 2 * n**3 / (timing.median * 1e-3) / 1e12
    # Significant digits, not decimal places: a CPU rate is a few GFLOP/s, which three decimals of TFLOP/s lose.
    return {"n": n, "dtype": str(env.dtype).replace("torch.", ""), "tflops": float(f"{tflops:.4g}"),
            **timing.summary()}


def floor_ms(params: int, tokens: int, tflops: float) -> float:
    """The matmul floor: ``2 x params x tokens`` flops at the measured matmul rate, in milliseconds."""
    if not tflops > 0:
        raise ValueError(f"floor_ms: tflops must be a positive measured matmul rate, got {tflops!r}; "
                         "measure it with matmul_rate()")
    return 2.0 * params * tokens / (tflops * 1e12) * 1e3


def measure(fn: Callable[[], Any], env: Env, **kw: Any) -> dict[str, Any]:
    """:func:`time_call` with failures caught: a summary, or ``{"error": ...}`` (the traceback goes to stderr)."""
    try:
        return time_call(fn, env, **kw).summary()
    except Exception as exc:
        traceback.print_exc()
        free_memory()
        return {"error": short_error(exc)}


def in_fresh_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on a new thread, joined; its result, or its exception raised here.

    For measurements that must leave the calling thread's caches as they were: torch keeps cuDNN's attention plans
    per thread (``getMHAGraphCache_`` in ``aten/src/ATen/native/cudnn/MHA.cpp``), so a floor timed on the thread
    that captures afterwards would leave plans behind for the lengths it timed, and the capture's crossover would
    find their "first" calls free (measured on the H200: a median plan cost of 0.15 ms instead of about 65, and the
    runner then bought a plan for every new photo size at once)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="encgraph-bench-measure")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")
