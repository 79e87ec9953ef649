"""The steps of one budget's capture (:func:`encgraph.capture.capture.capture_graphs` runs them in its phases):
its warm-up in the ordinary allocator, its capture into the graphs' pool, and what ends a capture that failed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from encgraph.capture.compiling import CompileMode
from encgraph.capture.execution import RunnerState, check_outputs
from encgraph.capture.recording import graph_calls
from encgraph.capture.records import GraphRecord
from encgraph.errors import EncgraphError

__all__ = ["CompileFailed", "PoolLeftRecording", "capture_one", "drop_failed", "end_failed_capture", "error_line",
           "forward_into", "pool_bytes", "warm_up"]

log = logging.getLogger("encgraph")

Forward = Callable[[Mapping[str, torch.Tensor], int], Mapping[str, torch.Tensor]]


class CompileFailed(Exception):
    """The first compiled run failed under ``compile="auto"``: the capture goes on with the plain forward."""


class PoolLeftRecording(Exception):
    """A capture failed (its error is the ``__cause__``) and left its pool recording: see
    :func:`end_failed_capture`."""


def warm_up(runner: RunnerState, path: str, budget: int, forward: Forward,
            compile_info: dict[str, Any]) -> tuple[float, float]:
    """``runner.warmup`` runs of the budget's forward on padding, on the calling thread's current stream (never the
    capture stream, which runs no eager work: :mod:`encgraph.capture.streams`), in the ordinary allocator; the
    path's output buffers are shaped from the first (and made at the path's first capture). Returns its
    seconds and the first compiled run's (0 when not compiling)."""
    device = runner.device
    t0 = time.perf_counter()
    views = runner.buffers[path].fill(budget, None)
    compiling = runner.compile_mode is not CompileMode.OFF and compile_info.get("status") != "failed"
    compile_seconds = 0.0
    for i in range(runner.warmup):
        t_run = time.perf_counter()
        try:
            with graph_calls():  # what the capture records is built here (cuDNN's plans: capture.recording)
                outputs = forward(views, budget)
        except EncgraphError:
            raise
        except Exception as exc:
            if not compiling or runner.compile_mode is not CompileMode.AUTO or compile_info.get("status"):
                raise
            _compile_failed(compile_info, exc)
            raise CompileFailed() from exc
        check_outputs(runner.adapter, path, budget, outputs, budget, "static")
        if i == 0:
            runner.outputs[path].learn(outputs, runner.ladders[path])
            if compiling:
                torch.cuda.synchronize(device)
                compile_seconds = time.perf_counter() - t_run
                compile_info.setdefault("status", "compiled")
                compile_info.setdefault("first_compile_seconds", round(compile_seconds, 3))
        del outputs
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0, compile_seconds


def capture_one(
    runner: RunnerState, pool: Any, path: str, budget: int, stream: torch.cuda.Stream, forward: Forward,
) -> GraphRecord:
    """Capture the budget's forward (warmed up by :func:`warm_up`) into ``pool`` on ``stream`` (the runner's own:
    :func:`encgraph.capture.streams.capture_stream`)."""
    device = runner.device
    t0 = time.perf_counter()
    views = runner.buffers[path].fill(budget, None)
    stream.wait_stream(torch.cuda.current_stream(device))
    torch.cuda.synchronize(device)
    outputs = runner.outputs[path]
    # The path's first capture (its largest budget): its outputs become the buffers where the ladder allows,
    # else the buffers are made outside the pool (once).
    adopting = not outputs.storage and outputs.adopts
    if not adopting:
        outputs.allocate()
    foreign = _storages(runner, views) if adopting else set()
    before = pool_bytes(device, pool)
    graph = torch.cuda.CUDAGraph()
    targets = {} if adopting else outputs.view(budget)
    with torch.cuda.stream(stream):
        try:
            with torch.cuda.graph(graph, pool=pool, stream=stream), graph_calls():
                if adopting:
                    targets = outputs.adopt(forward(views, budget), foreign)
                else:
                    forward_into(forward, views, budget, targets)
        except BaseException as exc:
            if adopting:  # a failed capture's tensors are no path's buffers
                outputs.storage.clear()
            if end_failed_capture(device, pool) and isinstance(exc, Exception) and not isinstance(exc, EncgraphError):
                raise PoolLeftRecording() from exc
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
    )


def _storages(runner: RunnerState, views: Mapping[str, torch.Tensor]) -> set[int]:
    """Storage addresses no output buffer may take over: the path's input buffers and the module's parameters
    and buffers (a forward may return either as an output). The module is read from the adapter's ``module``
    property, never from ``unwrap()``, which undoes what wrapping changed (a Qwen-VL adapter's attention and layer
    layout: the capture then ran the tower's own host-syncing attention and failed, H100 2026-12-07)."""
    module = getattr(runner.adapter, "module", None)
    if not isinstance(module, torch.nn.Module):
        module = None
    tensors = [*views.values(), *(module.parameters() if module is not None else ()),
               *(module.buffers() if module is not None else ())]
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def error_line(exc: BaseException) -> str:
    """``exc`` as one line for a log and a stats field: its type and the first line of its message, cut at 300."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def drop_failed(runner: RunnerState, path: str, budget: int, exc: BaseException, phase: str) -> None:
    """Drop ``budget`` of ``path`` whose ``phase`` raised ``exc`` (logged, the reason in ``runner.failed``)."""
    torch.cuda.synchronize(runner.device)
    runner.failed[path][budget] = error_line(exc)
    log.warning(
        "encgraph: %s of path %r at budget %d failed (%s); batches planned there move to the next budget, or run "
        "eagerly.", phase, path, budget, runner.failed[path][budget]
    )


def forward_into(forward: Forward, views: Mapping[str, torch.Tensor], budget: int,
                 targets: Mapping[str, torch.Tensor]) -> None:
    """The captured body of a budget whose outputs are not adopted: the forward, its outputs copied into the path's
    shared output buffers (the pool keeps no per-graph outputs; on a batch ladder the first capture's own outputs
    became them: :meth:`~encgraph.capture.buffers.PathOutputs.adopt`)."""
    produced = forward(views, budget)
    for name, target in targets.items():
        target.copy_(produced[name])
    del produced  # its memory goes back to the pool for the next (smaller) graph


def end_failed_capture(device: torch.device, pool: Any) -> bool:
    """End what a capture that raised inside ``torch.cuda.graph`` left open; whether it had left ``pool``
    recording.

    A capture that CUDA invalidated (a host sync or another call it forbids while capturing; an out-of-memory
    whose retry synchronises) makes the context's exit raise from ``capture_end``, where the caching allocators may
    still route the capture's allocations into the pool (and the context has not restored the stream: the caller's
    own stream context does). The pool then stays "recording", and every later ``capture_begin`` on it fails
    ("already recording to mempool_id"): every smaller budget failed with the first. Here the device allocator's
    routing ends, and the reference the capture took on the pool is released (no graph was made to release it),
    so that its memory goes with the graphs. The pinned host allocator (torch 2.13 routes it per pool too) has no
    Python call to end its routing: the caller captures the rest into a fresh pool.

    Whether or not the pool was left recording, the capture may have left torch's CUDA generator in its capture
    state: ``capture_end`` ends the allocator's routing before ``cudaStreamEndCapture``, whose error leaves the
    generator capturing (torch 2.11 on an H100, 2026-12-07: after a capture that ran a host-syncing attention, every
    later random op in the process raised "Offset increment outside graph capture encountered unexpectedly"). One
    small capture after every failed capture ends that state (harmless where there was none; logged where it
    cannot run)."""
    try:
        torch._C._cuda_endAllocateToPool(device.index, pool)
    except RuntimeError:  # "not currently recording": capture_end got that far
        recording = False
    else:
        torch._C._cuda_releasePool(device.index, pool)
        recording = True
    try:
        scratch = torch.zeros(1, device=device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # torch's default capture stream and a pool of its own, gone with the graph
            scratch.add_(1)
    except Exception as exc:  # noqa: BLE001 - the failed capture's own error is the one to raise
        log.warning("encgraph: could not end torch's CUDA generator's capture state after a failed capture (%s: %s); "
                    "random ops may raise 'Offset increment outside graph capture'.", type(exc).__name__, exc)
    return recording


def _compile_failed(info: dict[str, Any], exc: BaseException) -> None:
    reason = error_line(exc)
    info["status"] = "failed"
    info["reason"] = reason
    log.warning(
        "encgraph: compiling the static forward failed (%s); capturing the plain forward instead (compile='auto'; "
        "pass compile=False to skip compiling, compile=True to make this an error).", reason
    )


def pool_bytes(device: torch.device, pool: Any) -> int:
    """Bytes of the segments the caching allocator holds for the graphs' private ``pool`` on ``device``
    (the memory the captured graphs keep; the snapshot is cheap at capture time, never on the hot path)."""
    total = 0
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device") == device.index and tuple(seg.get("segment_pool_id", ())) == tuple(pool):
            total += int(seg["total_size"])
    return total
