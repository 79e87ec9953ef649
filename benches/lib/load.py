"""Closed-loop load and its numbers, for ``benches/serving.py``: clients that send one request, wait for its
answer and send the next, in threads (:func:`closed_loop`, any callable) or as asyncio tasks over HTTP
(:func:`http_closed_loop`, aiohttp), and :func:`window`, which turns one or several such runs of a point into its
images/s and latencies.

A run records every request's ``(sent, answered)`` times (``time.perf_counter()``) and the opening of its measured
window (``start``, after the warm-up). No request is sent after the window closes; those in flight then drain.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

__all__ = ["Run", "closed_loop", "http_closed_loop", "summarize", "window"]


@attrs.frozen
class Run:
    """One run of a point: ``spans`` ``(sent, answered)`` of every answered request, the window's ``start``, and
    ``errors`` (the first failure of each client that failed; it stopped there)."""

    spans: tuple[tuple[float, float], ...]
    start: float
    errors: tuple[str, ...] = ()


def summarize(latencies: Sequence[float], images: int, seconds: float) -> dict[str, Any]:
    """``requests`` (timed), ``images``, ``seconds``, ``images_per_s`` and P50 / P99 / mean latency in ms."""
    if not latencies or seconds <= 0:
        return {"requests": 0, "images_per_s": 0.0}
    ordered = sorted(latencies)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"requests": len(latencies), "images": images, "seconds": round(seconds, 3),
            "images_per_s": round(images / seconds, 2), "p50_ms": round(pick(0.5) * 1e3, 3),
            "p99_ms": round(pick(0.99) * 1e3, 3), "mean_ms": round(statistics.fmean(latencies) * 1e3, 3)}


def window(runs: Sequence[Run]) -> dict[str, Any]:
    """A point's numbers from its runs, pooled: images/s counts the requests answered after each run's ``start``
    over the time from that start to the run's last answer, summed over the runs; the latencies (``requests``,
    P50, P99, mean) are those of the requests sent at or after their run's ``start``. A request sent during the
    warm-up may have waited out the point's start-up (128 clients connecting at once, the pinned-memory pool
    growing) and would carry it into the window's tail. (Counted by their answers, as before 64e96d5, 128
    closed-loop clients of Qwen2.5-VL behind encgraph serve on the H200, tree cf9ded5, had a P99 of 2102 ms at a
    P50 of 424; which requests made it was not recorded.) ``errors``: over the runs; with several runs,
    ``runs``: each one's own images/s, P50 and P99."""
    latencies: list[float] = []
    answered, seconds = 0, 0.0
    for run in runs:
        done = [t1 for _, t1 in run.spans if t1 >= run.start]
        if done:
            answered += len(done)
            seconds += max(done) - run.start
        latencies += [t1 - t0 for t0, t1 in run.spans if t0 >= run.start]
    out = summarize(latencies, answered, seconds)
    errors = [e for run in runs for e in run.errors]
    out["errors"] = len(errors)
    if errors:
        out["first_error"] = errors[0]
    if len(runs) > 1:
        keys = ("images_per_s", "p50_ms", "p99_ms")
        out["runs"] = [{k: v for k, v in window([run]).items() if k in keys} for run in runs]
    return out


def closed_loop(send: Callable[[int], Any], concurrency: int, warmup: float, duration: float) -> Run:
    """``concurrency`` threads, client ``c`` calling ``send(k)`` for ``k = c, c + concurrency, ...`` back to back,
    from now for ``warmup + duration`` seconds, and each at least once at or after the window's start: a point
    whose requests outlast its window (a short smoke point on a busy CPU) still times one a client, where it had
    none to report (the CPU suite's in-process smoke failed so once in a fresh-machine CI run)."""
    start = time.perf_counter() + warmup
    stop = start + duration
    spans: list[tuple[float, float]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        k, timed = c, False
        while (t0 := time.perf_counter()) < stop or not timed:
            timed = t0 >= start
            try:
                send(k)
            except Exception as exc:  # recorded, never hidden
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                return
            t1 = time.perf_counter()
            with lock:
                spans.append((t0, t1))
            k += concurrency

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Run(tuple(spans), start, tuple(errors))


def http_closed_loop(url: str, path: str, bodies: Sequence[bytes], concurrency: int, warmup: float,
                     duration: float) -> Run:
    """``concurrency`` aiohttp tasks in a new event loop, client ``c`` posting ``bodies[k % len(bodies)]`` (JSON)
    to ``url + path`` for ``k = c, c + concurrency, ...`` (each at least once at or after the window's start, as
    in :func:`closed_loop`); an answer other than 200 is the client's error.
    aiohttp, not httpx: httpx's client cost 3.0 ms of CPU per request at 8 connections and 8.4 ms at 32 (against
    a server that answers at once, on this repository's 2-core CPU: 229 and 103 requests/s), so it, not the
    server, set the ceiling; aiohttp's cost 0.6-0.8 ms at 1-32."""
    import aiohttp

    headers = {"content-type": "application/json"}

    async def main() -> Run:
        start = time.perf_counter() + warmup
        stop = start + duration
        spans: list[tuple[float, float]] = []
        errors: list[str] = []
        connector = aiohttp.TCPConnector(limit=concurrency)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:
            async def client(c: int) -> None:
                k, timed = c, False
                while (t0 := time.perf_counter()) < stop or not timed:
                    timed = t0 >= start
                    async with session.post(path, data=bodies[k % len(bodies)], headers=headers) as r:
                        text = await r.read()
                        t1 = time.perf_counter()
                        if r.status != 200:
                            errors.append(f"{r.status}: {text[:200].decode(errors='replace')}")
                            return
                    spans.append((t0, t1))
                    k += concurrency

            await asyncio.gather(*(client(c) for c in range(concurrency)))
        return Run(tuple(spans), start, tuple(errors))

    return asyncio.run(main())
