"""Capture: every budget of every path into one shared graph memory pool, largest first (design rule 10).

Phases, for a :class:`~encgraph.EncoderGraphRunner` in GRAPH mode (called by ``runner.capture()`` under its lock
and under :func:`~encgraph.capture.grad.persistent`):

1. compile - with compilation on, one compiled static forward per path serves every budget
   (:mod:`encgraph.capture.compiling`); under ``compile="auto"`` a failure of its first run falls back to the
   plain forward for the whole runner, logged once and recorded in ``capture_info["compile"]``;
2. per budget, largest first: fill the budget's input views with padding, warm the forward up on a side stream,
   capture it, and copy its outputs into the path's shared output buffers *inside* the graph, so the pool keeps
   no per-graph outputs: its memory stays that of the largest graph however dense the ladder is;
3. time each replay (random floats in the buffers: zeros can run faster than real data).

A budget whose capture fails (out of memory, a kernel that cannot be captured) is logged and dropped; its
batches move to the next budget or run eagerly. Its capture is ended cleanly (:func:`_end_failed_capture`), so
that the other budgets and later captures still capture (into a fresh pool where the failed one could not be
put back).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from encgraph.capture.compiled_eager import CompiledEager
from encgraph.capture.compiling import (
    CompiledRegions,
    CompileMode,
    compile_cache,
    compile_dynamic,
    compile_stats,
    no_duck_sizing,
    recompile_headroom,
)
from encgraph.capture.execution import RunnerState, check_outputs
from encgraph.capture.records import GraphRecord
from encgraph.capture.timing import time_host
from encgraph.errors import EncgraphError

__all__ = ["capture_graphs", "pool_bytes", "time_replay", "fill_for_timing"]

log = logging.getLogger("encgraph")

Forward = Callable[[Mapping[str, torch.Tensor], int], Mapping[str, torch.Tensor]]


def capture_graphs(runner: RunnerState, pool: Any) -> dict[str, Any]:
    """Capture the runner's ladders into the graph memory pool ``pool`` (``torch.cuda.graph_pool_handle()``, kept
    by the runner for as long as the graphs live); return the capture summary (``capture_info``). A capture that
    left the pool recording (:func:`_end_failed_capture`) moves the budgets after it to a fresh pool
    (``capture_info["pools"]`` counts them)."""
    from tqdm.auto import tqdm

    device = runner.device
    todo = sorted(
        ((path, b) for path, ladder in runner.ladders.items() for b in ladder if b > 0), key=lambda pb: (-pb[1], pb[0])
    )
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    reserved0 = torch.cuda.memory_reserved(device)
    stream = torch.cuda.Stream(device)
    compile_info: dict[str, Any] = {"mode": runner.compile_mode.value}
    forwards = {path: _plain_forward(runner, path) for path in runner.ladders}
    regions = CompiledRegions(runner.adapter)
    pools = [pool]
    with contextlib.ExitStack() as stack:
        if runner.compile_mode is not CompileMode.OFF:
            compile_info["cache_dir"] = stack.enter_context(compile_cache(runner.cache_dir))
            compile_info["counters_before"] = compile_stats()
            stack.enter_context(no_duck_sizing())
            stack.enter_context(recompile_headroom())
            if regions.modules:
                # Regional: the repeated blocks are compiled (once: they share their code), the rest runs as is.
                stack.callback(regions.restore)
                regions.compile()
                compile_info["regions"] = regions.describe()
            else:
                forwards = {path: compile_dynamic(forwards[path], regions.dynamic) for path in forwards}
        bar = tqdm(todo, desc="encgraph: capture", unit="graph", disable=not runner.progress, leave=False)
        for path, budget in bar:
            bar.set_postfix_str(f"{path}@{budget}")
            record = None
            for _attempt in range(2):
                try:
                    record = _capture_one(runner, pool, path, budget, stream, forwards[path], compile_info)
                except _CompileFailed:
                    # compile="auto": the first compiled run failed; every path captures the plain forward.
                    regions.restore()
                    forwards = {p: _plain_forward(runner, p) for p in runner.ladders}
                    continue
                except EncgraphError:
                    raise
                except Exception as exc:  # OOM or a kernel that cannot be captured: drop this budget only
                    torch.cuda.synchronize(device)
                    cause = exc.__cause__ if isinstance(exc, _PoolLeftRecording) else exc
                    runner.failed[path][budget] = f"{type(cause).__name__}: {cause}".splitlines()[0][:300]
                    log.warning(
                        "encgraph: capture of path %r at budget %d failed (%s); batches planned there move to the "
                        "next budget, or run eagerly.", path, budget, runner.failed[path][budget]
                    )
                    if isinstance(exc, _PoolLeftRecording):
                        pool = torch.cuda.graph_pool_handle()
                        pools.append(pool)
                break
            if record is not None:
                runner.records[path][budget] = record
        bar.close()
        torch.cuda.synchronize(device)
        runner.compiled_eager = _keep_for_eager(runner, regions, compile_info)
        if "counters_before" in compile_info:
            before = compile_info.pop("counters_before")
            after = compile_stats()
            compile_info["dynamo"] = {k: after[k] - before[k] for k in after}
            if compile_info["dynamo"]["recompile_limit"] and compile_info.get("status") == "compiled":
                # Dynamo gave up on a frame at its recompile limit even with the headroom: that code ran (and
                # was captured) uncompiled. The graphs are correct; they are slower than compiled ones.
                compile_info["status"] = "partly compiled"
                compile_info["reason"] = (
                    f"torch's recompile limit was reached {compile_info['dynamo']['recompile_limit']} time(s) "
                    "during capture: some compiled code ran uncompiled (raise torch._dynamo.config."
                    "recompile_limit, or capture fewer kinds of towers in one process)"
                )
                log.warning("encgraph: %s.", compile_info["reason"])
    for path_records in runner.records.values():
        for record in path_records.values():
            record.replay_ms = time_replay(runner, record)
    seconds = time.perf_counter() - start
    pool_held = sum(pool_bytes(device, p) for p in pools)
    graphs = [r for rs in runner.records.values() for r in rs.values()]
    info = {
        "mode": runner.mode.value,
        "graphs": len(graphs),
        "seconds": round(seconds, 3),
        "compile": compile_info,
        "compile_seconds": round(sum(r.compile_seconds for r in graphs), 3),
        "pool_bytes": int(pool_held),
        "pools": len(pools),
        # Memory the warm-up runs left cached outside the pool (freed by torch.cuda.empty_cache()).
        "other_reserved_bytes": int(torch.cuda.memory_reserved(device) - reserved0 - pool_held),
        "largest_graph_bytes": max((r.memory_bytes for r in graphs), default=0),
        "buffer_bytes": sum(b.nbytes for b in runner.buffers.values()),
        "output_bytes": sum(o.nbytes for o in runner.outputs.values()),
        "failed": {p: dict(f) for p, f in runner.failed.items() if f},
        "per_graph": [r.summary() for r in sorted(graphs, key=lambda r: (r.path, r.budget))],
    }
    log.info(
        "encgraph: captured %d graphs in %.2f s (compile %s); pool %.1f MiB, static buffers %.1f MiB%s",
        info["graphs"], seconds, compile_info.get("status", compile_info["mode"]), pool_held / 2**20,
        info["buffer_bytes"] / 2**20,
        f"; {sum(len(f) for f in runner.failed.values())} failed" if info["failed"] else "",
    )
    return info


def _keep_for_eager(runner: RunnerState, regions: CompiledRegions, compile_info: Mapping[str, Any]) -> CompiledEager:
    """The compiled blocks, kept for the runner's eager forwards (:mod:`encgraph.capture.compiled_eager`) before
    the capture's exit clears them from the modules."""
    status = compile_info.get("status")
    if runner.compile_mode is CompileMode.OFF:
        return CompiledEager.off("compile is off")
    if not regions.modules:
        return CompiledEager.off("the adapter names no compile regions (its whole static forward was compiled)")
    if not regions.active or status not in ("compiled", "partly compiled"):
        return CompiledEager.off(f"compilation {status or 'did not run'}")
    return CompiledEager(regions)


class _CompileFailed(Exception):
    pass


class _PoolLeftRecording(Exception):
    """A capture failed (its error is the ``__cause__``) and left its pool recording: see
    :func:`_end_failed_capture`."""


def _plain_forward(runner: RunnerState, path: str) -> Forward:
    adapter = runner.adapter

    def forward(buffers: Mapping[str, torch.Tensor], budget: int) -> Mapping[str, torch.Tensor]:
        return adapter.forward_static(path, buffers, budget)

    return forward


def _capture_one(
    runner: RunnerState, pool: Any, path: str, budget: int, stream: torch.cuda.Stream, forward: Forward,
    compile_info: dict[str, Any],
) -> GraphRecord:
    device = runner.device
    t0 = time.perf_counter()
    views = runner.buffers[path].fill(budget, None)
    compiling = runner.compile_mode is not CompileMode.OFF and compile_info.get("status") != "failed"
    compile_seconds = 0.0
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for i in range(runner.warmup):
            t_run = time.perf_counter()
            try:
                outputs = forward(views, budget)
            except EncgraphError:
                raise
            except Exception as exc:
                if not compiling or runner.compile_mode is not CompileMode.AUTO or compile_info.get("status"):
                    raise
                _compile_failed(compile_info, exc)
                raise _CompileFailed() from exc
            check_outputs(runner.adapter, path, budget, outputs, budget, "static")
            if i == 0:
                runner.outputs[path].ensure(outputs, runner.ladders[path])
                if compiling:
                    torch.cuda.synchronize(device)
                    compile_seconds = time.perf_counter() - t_run
                    compile_info.setdefault("status", "compiled")
                    compile_info.setdefault("first_compile_seconds", round(compile_seconds, 3))
            del outputs
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        before = pool_bytes(device, pool)
        graph = torch.cuda.CUDAGraph()
        targets = runner.outputs[path].view(budget)
        try:
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                _forward_into(forward, views, budget, targets)
        except BaseException as exc:
            if _end_failed_capture(device, pool) and isinstance(exc, Exception) and not isinstance(exc, EncgraphError):
                raise _PoolLeftRecording() from exc
            raise
    torch.cuda.synchronize(device)
    return GraphRecord(
        path=path,
        budget=budget,
        graph=graph,
        inputs=views,
        outputs=targets,
        capture_seconds=time.perf_counter() - t0,
        memory_bytes=pool_bytes(device, pool) - before,
        compile_seconds=compile_seconds,
    )


def _forward_into(forward: Forward, views: Mapping[str, torch.Tensor], budget: int,
                  targets: Mapping[str, torch.Tensor]) -> None:
    """The captured body of a budget: the forward, its outputs copied into the path's shared
    output buffers (the pool keeps no per-graph outputs)."""
    produced = forward(views, budget)
    for name, target in targets.items():
        target.copy_(produced[name])
    del produced  # its memory goes back to the pool for the next (smaller) graph


def _end_failed_capture(device: torch.device, pool: Any) -> bool:
    """End what a capture that raised inside ``torch.cuda.graph`` left open; whether it had left ``pool``
    recording.

    A capture that CUDA invalidated (a host sync or another call it forbids while capturing; an out-of-memory
    whose retry synchronises) makes the context's exit raise from ``capture_end`` before the caching allocators
    stop routing the capture's allocations into the pool (and before the context restores the stream: the
    caller's own stream context does). The pool stays "recording", and every later ``capture_begin`` on it fails
    ("already recording to mempool_id"): every smaller budget failed with the first. Here the device allocator's
    routing ends, and the reference the capture took on the pool is released (no graph was made to release it),
    so that its memory goes with the graphs. The pinned host allocator (torch 2.13 routes it per pool too) has no
    Python call to end its routing: the caller captures the rest into a fresh pool. A capture whose body raised a
    Python error ended normally (``False``): the routing is over, and the graph object releases its reference when
    it goes."""
    try:
        torch._C._cuda_endAllocateToPool(device.index, pool)
    except RuntimeError:  # "not currently recording": capture_end got that far
        return False
    torch._C._cuda_releasePool(device.index, pool)
    return True


def _compile_failed(info: dict[str, Any], exc: BaseException) -> None:
    reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    info["status"] = "failed"
    info["reason"] = reason
    log.warning(
        "encgraph: compiling the static forward failed (%s); capturing the plain forward instead (compile='auto'; "
        "pass compile=False to skip compiling, compile=True to make this an error).", reason
    )


def time_replay(
    runner: RunnerState, record: GraphRecord, repeats: int = 5, values: Mapping[str, Any] | None = None
) -> float:
    """Host-seen ms of ``record``'s replay (minimum of spaced repeats), its buffers filled by
    :func:`fill_for_timing`."""
    fill_for_timing(runner, record, values)
    return time_host(record.graph.replay, repeats, runner.device)


def fill_for_timing(runner: RunnerState, record: GraphRecord, values: Mapping[str, Any] | None = None) -> None:
    """Fill ``record``'s buffers with ``values`` (``None``: all padding, one attention sequence over the budget,
    what the cost model's replay times are; the self-check also times other sequence bounds) and random floats."""
    # Time on random floats: zeros can run faster than real data.
    runner.buffers[record.path].fill(record.budget, values)
    for t in record.inputs.values():
        if t.is_floating_point():
            t.normal_()


def pool_bytes(device: torch.device, pool: Any) -> int:
    """Bytes of the segments the caching allocator holds for the graphs' private ``pool`` on ``device``
    (the memory the captured graphs keep; the snapshot is cheap at capture time, never on the hot path)."""
    total = 0
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device") == device.index and tuple(seg.get("segment_pool_id", ())) == tuple(pool):
            total += int(seg["total_size"])
    return total

