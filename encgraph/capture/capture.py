"""Capture: every budget of every path into one shared graph memory pool, largest first (design rule 10).

Phases, for a :class:`~encgraph.EncoderGraphRunner` in GRAPH mode (called by ``runner.capture()`` under its lock
and under :func:`~encgraph.capture.grad.persistent`):

1. compile - with compilation on, one compiled static forward per path serves every budget
   (:mod:`encgraph.capture.compiling`); under ``compile="auto"`` a failure of its first run falls back to the
   plain forward for the whole runner, logged once and recorded in ``capture_info["compile"]``;
2. warm-up - every budget, largest first: fill its input views with padding and run the forward on the calling
   stream (the compile runs here), in the ordinary allocator;
3. the caller's eager work (``before_capture``: the self-check's eager references and the cost model's eager
   timings, :class:`~encgraph.capture.selfcheck.SelfCheck`, which first gives back what the warm-ups left cached),
   with the blocks uncompiled and the static input buffers set aside (no eager run reads them), then the
   allocator's free cached segments are given back (:func:`~encgraph.capture.memory.release_cached`);
4. capture - every budget, largest first, with no eager run in between, on a stream of the runner's own that no
   eager work uses, its cuBLAS workspaces made in a pool of the stream's own, where nothing else can free them
   (:mod:`encgraph.capture.streams`): the forward, its outputs copied into the path's shared output buffers
   (allocated at the path's first capture) *inside* the graph, so the pool keeps no per-graph outputs: its memory
   stays that of the largest graph however dense the ladder is;
5. time each replay (random floats in the buffers: zeros can run faster than real data).

Why this order (memory): every eager forward of the capture runs, and gives its cached memory back, before the
pool holds anything, and nothing eager allocates while the pool is held. The capture's peak is then about the
larger of one eager forward's activations (the largest warm-up or self-check sample) and the pool (about one graph
of the top budget), beside the parameters and static buffers; warm-ups between captures, or eager references
after them, put an eager forward's activations beside the pool instead. And no eager allocation can land in the
pool: a tensor a module caches lazily in a warm-up (a position table, an index) lives in ordinary memory, where no
replay writes.

A budget whose warm-up or capture fails (out of memory, a kernel that cannot be captured) is logged and dropped;
its batches move to the next budget or run eagerly. A failed capture is ended cleanly
(:func:`~encgraph.capture.graph_steps.end_failed_capture`), so that the other budgets and later captures still capture (into a fresh pool
where the failed one could not be put back).
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
from encgraph.capture.execution import RunnerState
from encgraph.capture.graph_steps import CompileFailed as _CompileFailed
from encgraph.capture.graph_steps import Forward, pool_bytes
from encgraph.capture.graph_steps import PoolLeftRecording as _PoolLeftRecording
from encgraph.capture.graph_steps import capture_one as _capture_one
from encgraph.capture.graph_steps import drop_failed as _failed
from encgraph.capture.graph_steps import warm_up as _warm_up
from encgraph.capture.memory import peak_rise, release_cached
from encgraph.capture.records import GraphRecord
from encgraph.capture.streams import capture_stream
from encgraph.capture.timing import time_host
from encgraph.errors import EncgraphError

__all__ = ["capture_graphs", "pool_bytes", "time_replay", "fill_for_timing"]

log = logging.getLogger("encgraph")


def capture_graphs(runner: RunnerState, pool: Any, before_capture: Callable[[], None] | None = None,
                   memory: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """Capture the runner's ladders into the graph memory pool ``pool`` (``torch.cuda.graph_pool_handle()``, kept
    by the runner for as long as the graphs live); return the capture summary (``capture_info``). A capture that
    left the pool recording (:func:`~encgraph.capture.graph_steps.end_failed_capture`) moves the budgets after it to a fresh pool
    (``capture_info["pools"]`` counts them).

    ``before_capture`` runs after every warm-up and before the first graph is captured, with the compiled blocks
    uncompiled (the plain forward) and ``runner.compiled_eager`` set; a budget it adds to ``runner.failed`` is not
    captured. ``memory``: each phase's peak rise (:func:`~encgraph.capture.memory.peak_rise`): ``"warm-up"`` and
    ``"capture"`` (the captures and the replay timings after them; ``before_capture`` records its own)."""
    from tqdm.auto import tqdm

    device = runner.device
    memory = {} if memory is None else memory
    todo = sorted(
        ((path, b) for path, ladder in runner.ladders.items() for b in ladder if b > 0), key=lambda pb: (-pb[1], pb[0])
    )
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    reserved0 = torch.cuda.memory_reserved(device)
    compile_info: dict[str, Any] = {"mode": runner.compile_mode.value}
    forwards = {path: _plain_forward(runner, path) for path in runner.ladders}
    regions = CompiledRegions(runner.adapter)
    pools = [pool]
    warm_seconds: dict[tuple[str, int], tuple[float, float]] = {}
    capture_phase = contextlib.ExitStack()  # the captures' peak rise, through the replay timings after them
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
        bar = tqdm(total=2 * len(todo), desc="encgraph: capture", unit="step", disable=not runner.progress,
                   leave=False)
        with peak_rise(device, memory, "warm-up"):
            for path, budget in todo:
                bar.set_postfix_str(f"warm-up {path}@{budget}")
                for _attempt in range(2):
                    try:
                        warm_seconds[path, budget] = _warm_up(runner, path, budget, forwards[path], compile_info)
                    except _CompileFailed:
                        # compile="auto": the first compiled run failed; every path captures the plain forward.
                        regions.restore()
                        forwards = {p: _plain_forward(runner, p) for p in runner.ladders}
                        continue
                    except EncgraphError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - OOM, a kernel that fails: drop this budget only
                        _failed(runner, path, budget, exc, "warm-up")
                    break
                bar.update(1)
        runner.compiled_eager = _keep_for_eager(runner, regions, compile_info)
        if before_capture is not None:
            traced = compile_stats() if "counters_before" in compile_info else None
            with regions.paused(), contextlib.ExitStack() as aside:
                for path, buffers in runner.buffers.items():  # no eager run reads them, nor yet a graph
                    if not runner.records[path]:
                        aside.enter_context(buffers.set_aside())
                before_capture()
            if traced is not None:  # the compiled eager check's traces are not the capture's
                after = compile_stats()
                compile_info["counters_before"] = {k: v + after[k] - traced[k]
                                                   for k, v in compile_info["counters_before"].items()}
        release_cached(device)  # what the eager runs left cached goes back before the pool takes any
        capture_phase.enter_context(peak_rise(device, memory, "capture"))
        # The stream no eager work runs on, its cuBLAS workspaces primed in a pool of its own
        # (encgraph.capture.streams): here, not before the warm-ups, whose peak would hold them beside the calling
        # stream's (33 MiB each on an H100).
        before_priming = torch.cuda.memory_reserved(device)
        stream, stream_kind = capture_stream(runner, device)
        primed_bytes = torch.cuda.memory_reserved(device) - before_priming  # the stream's pool: not the capture's
        for path, budget in todo:
            bar.set_postfix_str(f"capture {path}@{budget}")
            bar.update(1)
            if budget in runner.failed[path]:  # its warm-up or its eager check failed
                continue
            try:
                record = _capture_one(runner, pool, path, budget, stream, forwards[path])
            except EncgraphError:
                raise
            except Exception as exc:  # OOM or a kernel that cannot be captured: drop this budget only
                _failed(runner, path, budget, exc.__cause__ if isinstance(exc, _PoolLeftRecording) else exc,
                        "capture")
                if isinstance(exc, _PoolLeftRecording):
                    pool = torch.cuda.graph_pool_handle()
                    pools.append(pool)
                continue
            record.capture_seconds += warm_seconds[path, budget][0]
            record.compile_seconds = warm_seconds[path, budget][1]
            runner.records[path][budget] = record
        bar.close()
        torch.cuda.synchronize(device)
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
    capture_phase.close()
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
        "capture_stream": stream_kind,
        # What the capture's work left cached outside the pool since the eager runs gave theirs back (the replay
        # timings; freed by torch.cuda.empty_cache()).
        "other_reserved_bytes": int(torch.cuda.memory_reserved(device) - reserved0 - pool_held - primed_bytes),
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


def _plain_forward(runner: RunnerState, path: str) -> Forward:
    adapter = runner.adapter

    def forward(buffers: Mapping[str, torch.Tensor], budget: int) -> Mapping[str, torch.Tensor]:
        return adapter.forward_static(path, buffers, budget)

    return forward


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


